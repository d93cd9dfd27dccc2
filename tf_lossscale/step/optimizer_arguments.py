"""What a `LossScaleOptimizer` accepts, checked before anything is built.

* The loss scale, in three spellings: tf_lossscale's `loss_scale=` (anything
  `tf_lossscale.get` takes), Keras 3's `initial_scale` and
  `dynamic_growth_steps`, and tf-keras' `dynamic`. Errors name the argument
  the caller typed (`initial_scale=-1`), not the loss scale's own names.
* The inner optimizer: a Keras optimizer, not itself a loss-scale wrapper,
  not already owned by another wrapper, without a `loss_scale_factor`.
* Base-optimizer arguments that Keras writes into saved wrapper configs,
  accepted at their defaults only.
* The inner optimizer's hyperparameters set on the wrapper later
  (`InnerHyperparameters`): the per-step ones (`weight_decay`, `clipnorm`,
  `clipvalue`, `global_clipnorm`, `ema_momentum`, `ema_overwrite_frequency`)
  read and write through, checked as Keras checks them; `use_ema` and
  `gradient_accumulation_steps` decide which slots the inner optimizer creates
  when it is built, and `loss_scale_factor` would scale the loss twice, so
  setting them raises.
* Under a bfloat16 compute dtype, a loss scale that scales gets a warning:
  bfloat16 has float32's range and needs no scaling.
"""

import warnings
import weakref

import keras

from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.loss_scales import loss_scale as loss_scale_lib
from tf_lossscale.loss_scales import serialization
from tf_lossscale._internal import checks

# Keras 3 writes these base-optimizer arguments into some saved wrapper
# configs. They are accepted at their defaults, as Keras does; anything else
# belongs on the inner optimizer.
_BASE_OPTIMIZER_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}

# Inner-optimizer hyperparameters read on every step: on the wrapper they read
# and write through to the inner optimizer.
_CLIPPING = ("clipnorm", "clipvalue", "global_clipnorm")

# Hyperparameters that cannot change on the wrapper: the first two decide
# which slots the inner optimizer creates when it is built; a loss scale
# factor would scale the loss a second time.
_FIXED_AT_WRAPPING = ("use_ema", "gradient_accumulation_steps",
                      "loss_scale_factor")

# Inner optimizer -> the wrapper that owns it. Two wrappers sharing one inner
# optimizer would each apply its update: the weights would move twice.
_OWNERS = weakref.WeakKeyDictionary()


def check_base_optimizer_kwargs(kwargs):
    """Raises unless every one of `kwargs` is a base-optimizer argument at
    its default (what Keras writes into saved wrapper configs)."""
    for key, value in kwargs.items():
        if key not in _BASE_OPTIMIZER_DEFAULTS:
            # Keys are argument names; a crafted config's may be huge.
            shown = key if len(key) <= 60 else checks.summary(key)
            raise TypeError(
                "LossScaleOptimizer got an unexpected argument "
                f"{shown}={checks.summary(value)}")
        if not _is_default(value, _BASE_OPTIMIZER_DEFAULTS[key]):
            raise ValueError(
                f"LossScaleOptimizer does not take "
                f"{key}={checks.summary(value)}; set {key} on the inner "
                "optimizer instead")


def _is_default(value, default):
    """Whether `value` is `default`, without `==` on arbitrary objects (an
    array's is ambiguous, a hostile one's may raise)."""
    if default is None or isinstance(default, bool):
        return value is default
    return (isinstance(value, float) and not isinstance(value, bool)
            and value == default)


def check_name(name):
    """Raises TypeError unless `name` is None or a string."""
    if not (name is None or isinstance(name, str)):
        raise TypeError(
            f"name must be a string or None, got {checks.summary(name)} "
            f"of type {type(name).__name__}")


def _check_forwarded_hyperparameter(inner, name, value):
    """Checks `value` for the inner optimizer's hyperparameter `name`."""
    if value is None and name != "ema_momentum":
        return
    if name == "ema_overwrite_frequency":
        checks.positive_int(name, value)
    elif name == "ema_momentum":
        if checks.finite_float32(name, value, at_least=0) > 1:
            raise ValueError(
                f"ema_momentum must be in [0, 1], got "
                f"{checks.summary(value)}")
    elif name == "weight_decay":
        checks.finite_float32(name, value, at_least=0)
    else:
        checks.finite_float32(name, value, above=0)
    if name in _CLIPPING:
        others = {other: getattr(inner, other) for other in _CLIPPING
                  if other != name and getattr(inner, other) is not None}
        if others:
            raise ValueError(
                f"Cannot set {name}={checks.summary(value)}: the inner "
                f"optimizer already clips with {others}; only one of "
                "clipnorm, clipvalue and global_clipnorm can be set")


def _forwarded_property(name):
    """A wrapper attribute that reads and writes the inner optimizer's.

    Keras' base constructor assigns every hyperparameter before the inner
    optimizer is attached; those defaults are kept apart and never used.
    """

    def getter(self):
        if "inner_optimizer" not in self.__dict__:
            return self.__dict__.get(f"_wrapper_{name}")
        return getattr(self.inner_optimizer, name)

    def setter(self, value):
        if "inner_optimizer" not in self.__dict__:
            self.__dict__[f"_wrapper_{name}"] = value
            return
        _check_forwarded_hyperparameter(self.inner_optimizer, name, value)
        setattr(self.inner_optimizer, name, value)

    return property(getter, setter, doc=(
        f"The inner optimizer's `{name}` (read and written through)."))


def resolve_loss_scale(loss_scale, dynamic, initial_scale,
                        dynamic_growth_steps):
    """Returns the `LossScale` for the constructor's arguments.

    Keras-style arguments are checked under the names the caller used, so an
    error says `initial_scale=-1`, not the loss scale's own argument name.
    """
    if dynamic is None and initial_scale is None and (
            dynamic_growth_steps is None):
        resolved = serialization.get_argument("loss_scale", loss_scale)
        if resolved is None:
            raise ValueError(
                "loss_scale must not be None: a LossScaleOptimizer needs a "
                "loss scale (a number, 'dynamic', a LossScale or a dict)")
        return resolved
    summary = checks.summary
    if not (isinstance(loss_scale, str) and loss_scale == "dynamic"):
        raise ValueError(
            f"loss_scale={summary(loss_scale)} conflicts with "
            f"dynamic={summary(dynamic)}, initial_scale="
            f"{summary(initial_scale)}, dynamic_growth_steps="
            f"{summary(dynamic_growth_steps)}: give either loss_scale or the "
            "Keras-style arguments, not both")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be a bool, got {summary(dynamic)}")
    if dynamic is False:
        if initial_scale is None or dynamic_growth_steps is not None:
            raise ValueError(
                "dynamic=False needs initial_scale (the fixed scale) and no "
                "dynamic_growth_steps, got initial_scale="
                f"{summary(initial_scale)}, dynamic_growth_steps="
                f"{summary(dynamic_growth_steps)}")
        checks.finite_float32("initial_scale", initial_scale, at_least=1)
        return loss_scale_lib.FixedLossScale(initial_scale)
    if initial_scale is not None:
        checks.finite_float32("initial_scale", initial_scale, above=0)
    if dynamic_growth_steps is not None:
        checks.positive_int("dynamic_growth_steps", dynamic_growth_steps)
    given = {"initial_loss_scale": initial_scale,
             "increment_period": dynamic_growth_steps}
    # Keras' dynamic scale always grows and shrinks by 2.
    return dynamic_loss_scale.DynamicLossScale(
        multiplier=2.0,
        **{name: value for name, value in given.items() if value is not None})


def check_inner_optimizer(inner_optimizer):
    """Raises unless `inner_optimizer` is a Keras 3 optimizer this wrapper
    may own (see the module docstring)."""
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise checks.DoubleScalingError(
            f"inner_optimizer {checks.summary(inner_optimizer)} is "
            "already a LossScaleOptimizer; wrapping it again would scale the "
            "loss twice")
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "inner_optimizer must be a keras.optimizers.Optimizer instance, "
            f"got {checks.summary(inner_optimizer)} of type "
            f"{type(inner_optimizer).__name__}")
    check_unowned(inner_optimizer)
    if inner_optimizer.loss_scale_factor is not None:
        raise ValueError(
            f"inner_optimizer has loss_scale_factor="
            f"{checks.summary(inner_optimizer.loss_scale_factor)}; the "
            "LossScaleOptimizer scales the loss itself, so leave it unset")


def check_unowned(inner_optimizer):
    """Raises ValueError if another wrapper owns `inner_optimizer`."""
    owner = _OWNERS.get(inner_optimizer)
    if owner is not None and owner() is not None:
        raise ValueError(
            f"inner_optimizer {checks.summary(inner_optimizer.name)} is "
            "already wrapped by "
            "another LossScaleOptimizer; give each wrapper its own optimizer")


def warn_if_scaling_bfloat16(loss_scale):
    policy = keras.mixed_precision.global_policy()
    if policy.compute_dtype != "bfloat16":
        return
    if isinstance(loss_scale, loss_scale_lib.FixedLossScale) and (
            loss_scale.loss_scale_value == 1):
        return
    warnings.warn(
        f"LossScaleOptimizer built under the {policy.name!r} dtype policy "
        f"with {loss_scale!r}: bfloat16 has float32's range, so its "
        "gradients do not underflow and scaling them only costs time. To "
        "keep skipping steps with NaN/Inf gradients without scaling, use "
        "loss_scale=tf_lossscale.FixedLossScale(1, skip_non_finite=True).",
        UserWarning, stacklevel=3)


def claim(inner_optimizer, wrapper):
    """Records that `wrapper` owns `inner_optimizer` (see `_OWNERS`)."""
    _OWNERS[inner_optimizer] = weakref.ref(wrapper)


class InnerHyperparameters:
    """The inner optimizer's hyperparameters, as seen on the wrapper.

    A mixin for the wrapper class, which keeps the inner optimizer in
    `inner_optimizer`. Per-step hyperparameters read and write through;
    setting a build-time one (`_FIXED_AT_WRAPPING`) raises a ValueError that
    says where to set it, instead of being silently ignored.
    """

    weight_decay = _forwarded_property("weight_decay")
    clipnorm = _forwarded_property("clipnorm")
    clipvalue = _forwarded_property("clipvalue")
    global_clipnorm = _forwarded_property("global_clipnorm")
    ema_momentum = _forwarded_property("ema_momentum")
    ema_overwrite_frequency = _forwarded_property("ema_overwrite_frequency")

    def __setattr__(self, name, value):
        if name in _FIXED_AT_WRAPPING and "inner_optimizer" in self.__dict__:
            reason = (" (the wrapper scales the loss itself)"
                      if name == "loss_scale_factor" else "")
            raise ValueError(
                f"Cannot set {name}={checks.summary(value)} on a "
                f"LossScaleOptimizer{reason}: "
                "set it on the inner optimizer before wrapping it, e.g. "
                f"LossScaleOptimizer(keras.optimizers.Adam({name}=...))")
        super().__setattr__(name, value)

"""What the Keras 3 and the tf-keras `LossScaleOptimizer`s share.

`ScaledLossProtocol`: Keras' attributes of a loss-scale wrapper, both step
protocols (Keras 3's and TF 2.x's) and the overflow report. How arguments
and configs read: `resolve_loss_scale` (also for TF1), `constructor_arguments`;
`InnerHyperparameters`: the Keras 3 wrapper's view of its inner optimizer's.
"""

import os
import re

import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.loss_scales import loss_scale as loss_scale_lib
from tf_lossscale.loss_scales import serialization
from tf_lossscale.ops import finiteness
from tf_lossscale.ops import unscaling
from tf_lossscale.step import loss_scaled_step

# tf-keras' variable names end in the `:0` of the tensor they output.
_OUTPUT_SUFFIX = re.compile(r":\d+$")


def comes_from_tf_keras(obj):
    """Whether `obj`'s class, or a base of it, is defined in tf_keras (read
    from module names: Keras 3 users never import tf_keras)."""
    return any(klass.__module__.split(".")[0] == "tf_keras"
               for klass in type(obj).__mro__)


def tf_keras_is_tf_keras():
    """Whether `tf.keras` is tf-keras: TensorFlow's own switch."""
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


def wrapper_config(optimizer, serialized_inner):
    """The config of a wrapper whose inner optimizer serialized as given."""
    loss_scale = serialization.serialize(optimizer._loss_scale)  # pylint: disable=protected-access
    return {"name": optimizer.name, "inner_optimizer": serialized_inner,
            "loss_scale": loss_scale}


def constructor_arguments(config, custom_objects, optimizer_types=()):
    """`(inner, kwargs)` of a wrapper's constructor from a config of any
    shape met in saved files: ours, `{"name", "inner_optimizer",
    "loss_scale"}`; Keras 3's, `{"name", "inner_optimizer", "initial_scale",
    "dynamic_growth_steps"}` (at times with base-optimizer arguments at their
    defaults); tf-keras', `{"inner_optimizer", "dynamic", "initial_scale",
    "dynamic_growth_steps"}`; TF 2.1-2.3's, `{"optimizer", "loss_scale"}`."""
    key = checks.optimizer_config(config, custom_objects, optimizer_types)
    kwargs = dict(config)
    return kwargs.pop(key), kwargs


# Base-optimizer arguments Keras 3 writes into saved wrapper configs.
_BASE_OPTIMIZER_DEFAULTS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
    "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
    "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None}


def check_base_optimizer_arguments(kwargs):
    """Raises unless each of `kwargs` is a base-optimizer argument at its
    default: the same object, or an equal float (`==` on others may raise)."""
    summary = checks.summary
    for key, value in kwargs.items():
        if key not in _BASE_OPTIMIZER_DEFAULTS:
            shown = key if len(key) <= 60 else summary(key)  # A crafted key.
            raise TypeError("LossScaleOptimizer got an unexpected argument "
                            f"{shown}={summary(value)}")
        default = _BASE_OPTIMIZER_DEFAULTS[key]
        if not (value is default or isinstance(value, float)
                and isinstance(default, float) and value == default):
            raise ValueError(f"LossScaleOptimizer does not take {key}="
                             f"{summary(value)}; set {key} on the inner "
                             "optimizer instead")


def resolve_loss_scale(loss_scale, dynamic=None, initial_scale=None,
                       dynamic_growth_steps=None, own_types=()):
    """The `LossScale` of `loss_scale` (what `tf_lossscale.get` takes, or of
    `own_types`), or of Keras' and tf-keras' arguments, refused under the
    names the caller typed, in tf-keras' phrases."""
    summary = checks.summary
    if dynamic is not None and not isinstance(dynamic, bool):
        # tf-keras' second positional argument is `dynamic`; ours loss_scale.
        raise TypeError(
            '"dynamic" argument to LossScaleOptimizer.__init__ must be a '
            f"bool, but got: {summary(dynamic)} (a loss scale goes in "
            "loss_scale=)")
    if dynamic is False and initial_scale is None:
        raise ValueError('"initial_scale" must be specified if "dynamic" is '
                         "False: it is the fixed scale")
    if dynamic is False and dynamic_growth_steps is not None:
        raise ValueError('"dynamic_growth_steps" must be None if "dynamic" '
                         f"is False, but got: {summary(dynamic_growth_steps)}")
    keras_style = {"dynamic": dynamic, "initial_scale": initial_scale,
                   "dynamic_growth_steps": dynamic_growth_steps}
    if all(value is None for value in keras_style.values()):
        if loss_scale is None:
            raise ValueError("loss_scale cannot be None: use 'dynamic', a "
                             "number, a LossScale or a serialized loss scale")
        if isinstance(loss_scale, own_types):
            return loss_scale
        return serialization.get_argument("loss_scale", loss_scale)
    if not (isinstance(loss_scale, str) and loss_scale == "dynamic"):
        given = ", ".join(f"{k}={summary(v)}" for k, v in keras_style.items())
        raise ValueError(f"loss_scale={summary(loss_scale)} conflicts with "
                         f"{given}: give either loss_scale or the Keras-style "
                         "arguments, not both")
    if dynamic is False:
        checks.finite_float32("initial_scale", initial_scale, at_least=1)
        return loss_scale_lib.FixedLossScale(initial_scale)
    given = {}
    if initial_scale is not None:
        checks.finite_float32("initial_scale", initial_scale, above=0)
        given["initial_loss_scale"] = initial_scale
    if dynamic_growth_steps is not None:
        checks.positive_int("dynamic_growth_steps", dynamic_growth_steps)
        given["increment_period"] = dynamic_growth_steps
    # Keras' dynamic scale always grows and shrinks by 2.
    return dynamic_loss_scale.DynamicLossScale(multiplier=2.0, **given)


# Hyperparameters read on every step read and write the inner optimizer's,
# checked as Keras' constructor checks them (Keras checks no later change).
_CLIPPING = ("clipnorm", "clipvalue", "global_clipnorm")
_BOUNDS = {"weight_decay": {"at_least": 0},
           "ema_momentum": {"at_least": 0, "at_most": 1}}
# The first two decide which slots the inner optimizer builds; a loss scale
# factor would scale the loss twice: setting them on the wrapper raises.
_FIXED_AT_WRAPPING = ("use_ema", "gradient_accumulation_steps",
                      "loss_scale_factor")


def _check_hyperparameter(inner, name, value):
    if value is None and name != "ema_momentum":
        return
    if name == "ema_overwrite_frequency":
        checks.positive_int(name, value)
    else:
        checks.finite_float32(name, value, **_BOUNDS.get(name, {"above": 0}))
    clipping = {other: getattr(inner, other) for other in _CLIPPING
                if name in _CLIPPING and other != name
                and getattr(inner, other) is not None}
    if clipping:
        raise ValueError(
            f"Cannot set {name}={checks.summary(value)}: the inner optimizer "
            f"already clips with {clipping}; only one of clipnorm, clipvalue "
            "and global_clipnorm can be set")


def _forwarded(name):
    """The inner optimizer's `name`, read and written through; what Keras'
    base constructor sets before the inner optimizer is attached is unused."""

    def getter(self):
        if "inner_optimizer" not in self.__dict__:
            return self.__dict__.get(f"_wrapper_{name}")
        return getattr(self.inner_optimizer, name)

    def setter(self, value):
        if "inner_optimizer" not in self.__dict__:
            self.__dict__[f"_wrapper_{name}"] = value
            return
        _check_hyperparameter(self.inner_optimizer, name, value)
        setattr(self.inner_optimizer, name, value)

    return property(getter, setter, doc=(
        f"The inner optimizer's `{name}` (read and written through)."))


class InnerHyperparameters:
    """The inner optimizer's hyperparameters as the (Keras 3) wrapper's."""

    weight_decay = _forwarded("weight_decay")
    clipnorm = _forwarded("clipnorm")
    clipvalue = _forwarded("clipvalue")
    global_clipnorm = _forwarded("global_clipnorm")
    ema_momentum = _forwarded("ema_momentum")
    ema_overwrite_frequency = _forwarded("ema_overwrite_frequency")

    def __setattr__(self, name, value):
        if name in _FIXED_AT_WRAPPING and "inner_optimizer" in self.__dict__:
            reason = (" (the wrapper scales the loss itself)"
                      if name == "loss_scale_factor" else "")
            raise ValueError(
                f"Cannot set {name}={checks.summary(value)} on a "
                f"LossScaleOptimizer{reason}: set it on the inner optimizer "
                "before wrapping it, e.g. "
                f"LossScaleOptimizer(keras.optimizers.Adam({name}=...))")
        super().__setattr__(name, value)


class ScaledLossProtocol:
    """The loss-scale attributes, both step protocols and the overflow
    report of a Keras wrapper, which sets `_loss_scale`, `_skipped_steps`
    and `_last_nonfinite` (one int32 flag per variable it was built with, or
    None) and calls `_reset_protocol()` in its constructor."""

    # Per-step gradient statistics, opted in by `gradient_stats.attach`.
    _gradient_stats = None

    def _stats_for(self, variables):
        stats = self._gradient_stats
        return None if stats is None else stats.selection(variables)

    def _reset_protocol(self):
        # The protocol `apply_gradients` follows is the last one called;
        # get_scaled_loss awaits get_unscaled_gradients; the gradients of a
        # loss never scaled are applied as given (tf-keras).
        self._caller_unscales = self._awaiting_unscale = False
        self._loss_scaled = False

    @property
    def loss_scale(self):
        """The `tf_lossscale.LossScale`; call it for the current scale."""
        return self._loss_scale

    @property
    def skipped_steps(self):
        """Steps skipped for non-finite gradients, a scalar int64 tensor."""
        return tf.convert_to_tensor(self._skipped_steps)

    @property
    def dynamic(self):
        """Whether the loss scale is dynamic (a `DynamicLossScale`)."""
        return isinstance(self._loss_scale, dynamic_loss_scale.DynamicLossScale)

    @property
    def dynamic_scale(self):
        """The current scale, as Keras' own LossScaleOptimizer names it."""
        return self._loss_scale()

    @property
    def dynamic_counter(self):
        """Good steps since the scale last changed; None for a fixed scale."""
        return self._loss_scale.good_steps if self.dynamic else None

    @property
    def initial_scale(self):
        config = self._loss_scale.get_config()
        return config.get("initial_loss_scale",
                          config.get("loss_scale_value"))

    @property
    def dynamic_growth_steps(self):
        return self._loss_scale.get_config().get("increment_period")

    def scale_loss(self, loss):
        """Keras 3 protocol: returns `loss * scale`; `apply_gradients` then
        takes the scaled gradients and unscales them."""
        self._caller_unscales = self._awaiting_unscale = False
        self._loss_scaled = True
        return loss_scaled_step.scale_loss(loss, self._loss_scale)

    def get_scaled_loss(self, loss):
        """TF 2.x protocol: returns `loss * scale` in the loss's dtype (for a
        callable `loss`, a callable). Unscale the gradients with
        `get_unscaled_gradients` before `apply_gradients`."""
        self._caller_unscales = False
        self._awaiting_unscale = self._loss_scaled = True
        return loss_scaled_step.scale_loss(loss, self._loss_scale)

    def get_unscaled_gradients(self, grads):
        """TF 2.x protocol: returns `grads / scale`, structure and dtypes
        kept; None stays None, `tf.IndexedSlices` stay IndexedSlices."""
        checks.gradients(grads)
        self._caller_unscales = True
        self._awaiting_unscale = False
        return unscaling.unscale_structure(grads, self._loss_scale())

    def check_unscaled(self):
        """Raises ValueError after `get_scaled_loss` without
        `get_unscaled_gradients`: the gradients still hold the scale."""
        if self._awaiting_unscale:
            raise ValueError(
                "apply_gradients got the gradients of get_scaled_loss's loss, "
                "still multiplied by the loss scale: call optimizer."
                "get_unscaled_gradients(grads) first, or scale_loss(loss) "
                "instead of get_scaled_loss (apply_gradients then unscales).")

    def check_finite(self, grads):
        """Whether every gradient on this replica is finite (a bool tensor)."""
        return finiteness.all_finite(grads)

    def _nonfinite_paths(self, variables):
        """Paths of `variables` (those built for) flagged on the last skipped
        step: Keras 3's `variable.path`, or a tf-keras name without its `:0`
        (the same for a functional model). Syncs device and host."""
        if self._last_nonfinite is None:
            return []
        flagged = [variable for variable, flag in zip(
            variables, self._last_nonfinite.numpy()) if flag]
        return [v.path if isinstance(getattr(v, "path", None), str)
                else _OUTPUT_SUFFIX.sub("", v.name) for v in flagged]

"""How the optimizer wrappers read their loss-scale and Keras arguments:
`resolve_loss_scale` and `claim` (the loss scale a wrapper holds),
`warn_if_scaling_bfloat16`, `check_base_optimizer_arguments` (what Keras
writes into saved configs) and `InnerHyperparameters` (the Keras 3
wrapper's, its inner optimizer's)."""

import warnings

from tf_lossscale._internal import checks
from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale import groups as group_lib
from tf_lossscale.loss_scales import loss_scale as loss_scale_lib
from tf_lossscale.loss_scales import serialization

# Base-optimizer arguments Keras 3 writes into saved wrapper configs.
_BASE_OPTIMIZER_DEFAULTS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
    "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
    "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None}


def warn_if_scaling_bfloat16(loss_scale, policy):
    """Warns (a `UserWarning`) when a wrapper is made under a bfloat16
    `policy` (its Keras' global one) with any loss scale but a fixed 1."""
    loss_scale = group_lib.underlying(loss_scale)
    scales = not (isinstance(loss_scale, loss_scale_lib.FixedLossScale)
                  and loss_scale.loss_scale_value == 1)
    if policy.compute_dtype == "bfloat16" and scales:
        warnings.warn(
            f"LossScaleOptimizer built under the {policy.name!r} dtype policy "
            f"with {loss_scale!r}: bfloat16 has float32's range, so its "
            "gradients do not underflow and scaling them only costs time. To "
            "keep skipping steps with NaN/Inf gradients without scaling, use "
            "loss_scale=tf_lossscale.FixedLossScale(1, skip_non_finite=True).",
            UserWarning, stacklevel=3)


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
    `own_types`), or of Keras' and tf-keras' arguments (a dynamic scale
    grows and shrinks by 2, as Keras')."""
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
    return dynamic_loss_scale.DynamicLossScale(multiplier=2.0, **given)


def _name_of(optimizer):
    name = getattr(optimizer, "name", None)
    if not isinstance(name, str) and hasattr(optimizer, "get_name"):
        name = optimizer.get_name()  # A TF1 optimizer's.
    return f"{type(optimizer).__name__} {name!r}"


def claim(loss_scale, owner):
    """The loss scale the wrapper `owner` holds, from `resolve_loss_scale`'s:
    for a `LossScaleGroup`, a new member of it; else the loss scale itself,
    with a `SharedLossScaleWarning` if it has state and another living
    wrapper holds it (each would count its own steps as the scale's).

    Raises, before anything is changed:
      ValueError: `loss_scale` belongs to a group (give the group) or is a
        member another wrapper holds, or the group cannot take the wrapper
        (`LossScaleGroup.check_joinable`).
    """
    if isinstance(loss_scale, group_lib.LossScaleGroup):
        member = loss_scale.join(owner)
        loss_scale_lib.add_holder(member, owner)
        return member
    if not isinstance(loss_scale, loss_scale_lib.LossScale):
        return loss_scale  # TensorFlow's own, in the TF1 wrapper.
    group = group_lib.group_of(loss_scale)
    if group is not None:
        raise ValueError(
            f"loss_scale={loss_scale!r} is the loss scale of a LossScaleGroup"
            ": give the optimizer the group itself (loss_scale=group), which "
            "moves the scale once per iteration of all its optimizers")
    holders = loss_scale_lib.holders(loss_scale)
    if holders and isinstance(loss_scale, group_lib.GroupMember):
        raise ValueError(
            f"loss_scale={loss_scale!r} is the group member of "
            f"{_name_of(holders[0])}; give each optimizer the "
            "LossScaleGroup itself (loss_scale=group): each gets a member")
    if isinstance(loss_scale, group_lib.GroupMember):
        loss_scale.adopt(owner)  # Joined by hand: its optimizer is `owner`.
    if holders and loss_scale.variables:
        others = ", ".join(_name_of(holder) for holder in holders)
        warnings.warn(
            f"This optimizer gets the {type(loss_scale).__name__} that "
            f"{others} holds already. Each optimizer's step is then a step of "
            "the loss scale: it moves once per optimizer step, not once per "
            "training iteration (with increment_period=N and two optimizers "
            "stepping every iteration it grows after N/2 iterations), and "
            "their checkpoints hold it twice. To share one loss scale, give "
            "every optimizer a tf_lossscale.LossScaleGroup(loss_scale) "
            "instead (docs/guides/several-optimizers.md).",
            checks.SharedLossScaleWarning, stacklevel=checks.user_stacklevel())
    loss_scale_lib.add_holder(loss_scale, owner)
    return loss_scale


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
    unused = f"_wrapper_{name}"

    def getter(self):
        inner = self.__dict__.get("inner_optimizer")
        return self.__dict__.get(unused) if inner is None else getattr(
            inner, name)

    def setter(self, value):
        inner = self.__dict__.get("inner_optimizer")
        if inner is None:
            self.__dict__[unused] = value
        else:
            _check_hyperparameter(inner, name, value)
            setattr(inner, name, value)

    return property(getter, setter, doc=f"The inner optimizer's `{name}`.")


class InnerHyperparameters:
    """Mixin: the inner optimizer's hyperparameters as the wrapper's."""

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


for _name in ("weight_decay", *_CLIPPING, "ema_momentum",
              "ema_overwrite_frequency"):
    setattr(InnerHyperparameters, _name, _forwarded(_name))

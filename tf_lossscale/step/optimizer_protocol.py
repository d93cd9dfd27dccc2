"""What the Keras 3 and the tf-keras `LossScaleOptimizer`s share.

`ScaledLossProtocol`: Keras' attributes of a loss-scale wrapper, both step
protocols (Keras 3's and TF 2.x's), the overflow report and the config;
`built_for`: the variables a wrapper was built for; `comes_from_tf_keras`
and `tf_keras_is_tf_keras`: which Keras is meant.
"""

import os
import re

import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale import groups as group_lib
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


def built_for(wrapper):
    """The variables a wrapper (Keras 3's or tf-keras') was built for, in
    build order; None before it is built."""
    if wrapper._last_nonfinite is None:  # pylint: disable=protected-access
        return None
    return list(wrapper._built_for)  # pylint: disable=protected-access


def tf_keras_is_tf_keras():
    """Whether `tf.keras` is tf-keras: TensorFlow's own switch."""
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


class ScaledLossProtocol:
    """Mixin of both Keras wrappers. A wrapper sets `_loss_scale` and
    `_skipped_steps`, and `_last_nonfinite` (one int32 flag per variable)
    when built; it gives `_built_for` (the variables it was built for),
    `_positions(variables)` (their indices there) and `_serialize_inner()`
    (its Keras' config of the inner optimizer)."""

    _gradient_stats = None  # Per-step statistics: `gradient_stats.attach`.
    _last_nonfinite = None
    # The protocol `apply_gradients` follows is the last one called;
    # get_scaled_loss awaits get_unscaled_gradients; the gradients of a loss
    # never scaled are applied as given (tf-keras).
    _caller_unscales = _awaiting_unscale = _loss_scaled = False

    def _stats_for(self, variables):
        stats = self._gradient_stats
        return None if stats is None else stats.selection(variables)

    @property
    def loss_scale(self):
        """The `tf_lossscale.LossScale`; call it for the current scale. With
        a `LossScaleGroup`, the optimizer's `GroupMember` of it."""
        return self._loss_scale

    @property
    def loss_scale_group(self):
        """The `LossScaleGroup` the optimizer is in, or None."""
        member = self._loss_scale
        return member.group if isinstance(member, group_lib.GroupMember) else (
            None)

    @property
    def skipped_steps(self):
        """Steps skipped for non-finite gradients, a scalar int64 tensor."""
        return tf.convert_to_tensor(self._skipped_steps)

    @property
    def dynamic(self):
        """Whether the loss scale is dynamic (a `DynamicLossScale`)."""
        return isinstance(group_lib.underlying(self._loss_scale),
                          dynamic_loss_scale.DynamicLossScale)

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
        config = group_lib.underlying(self._loss_scale).get_config()
        return config.get("initial_loss_scale", config.get("loss_scale_value"))

    @property
    def dynamic_growth_steps(self):
        return group_lib.underlying(self._loss_scale).get_config().get(
            "increment_period")

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

    def last_nonfinite_variables(self):
        """The paths of the variables whose gradients held NaN or +-Inf on
        the most recent skipped step, on any replica or worker, in build
        order; `[]` before one. A path is Keras 3's `variable.path`, or a
        tf-keras name without its `:0`. Syncs device and host."""
        if self._last_nonfinite is None:
            return []
        flagged = [variable for variable, flag in zip(
            self._built_for, self._last_nonfinite.numpy()) if flag]
        return [v.path if isinstance(getattr(v, "path", None), str)
                else _OUTPUT_SUFFIX.sub("", v.name) for v in flagged]

    @property
    def _skip_record(self):
        """What a skipped step writes; `variables` default to `_built_for`."""
        return loss_scaled_step.SkipRecord(
            self._skipped_steps, self._last_nonfinite,
            lambda variables: self._positions(variables or self._built_for))

    def get_config(self):
        return {"name": self.name, "inner_optimizer": self._serialize_inner(),
                "loss_scale": serialization.serialize(self._loss_scale)}

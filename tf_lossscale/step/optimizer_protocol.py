"""What the Keras 3 and the tf-keras `LossScaleOptimizer`s share.

`ScaledLossProtocol` is a mixin for both wrapper classes (each keeps its
`LossScale` in `_loss_scale` and its skipped-step counter in
`_skipped_steps`). It holds, once:

* the attributes Keras' and tf-keras' wrappers have (`loss_scale`, `dynamic`,
  `dynamic_scale`, `dynamic_counter`, `initial_scale`,
  `dynamic_growth_steps`) and `skipped_steps`;
* the two protocols of a training step and their bookkeeping:
  - Keras 3 (`fit` of Keras 3): `scale_loss(loss)`, then `apply_gradients`
    with the *scaled* gradients, which the wrapper unscales;
  - TF 2.x (tf-keras' `fit` and `minimize`, custom loops):
    `get_scaled_loss(loss)`, `get_unscaled_gradients(grads)`, then
    `apply_gradients` with *unscaled* gradients.
  `apply_gradients` follows whichever was called last (while tracing, in a
  `tf.function`); `get_scaled_loss` followed by `apply_gradients` without
  `get_unscaled_gradients` raises (`check_unscaled`) instead of applying
  gradients still multiplied by the scale;
* the config both write: `{"name", "inner_optimizer", "loss_scale"}`.

`comes_from_tf_keras(obj)` tells a tf-keras object from a Keras 3 one by its
class's module, without importing tf_keras; `tf_keras_is_tf_keras()` whether
`tf.keras` is tf-keras (`TF_USE_LEGACY_KERAS`).
"""

import os

import tensorflow as tf

from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.ops import finiteness
from tf_lossscale.step import loss_scaled_step
from tf_lossscale.loss_scales import serialization
from tf_lossscale._internal import step_arguments
from tf_lossscale.ops import unscaling


def comes_from_tf_keras(obj):
    """Whether `obj`'s class, or a base of it, is defined in tf_keras.

    Reads module names only, so Keras 3 users never import tf_keras.
    """
    return any(klass.__module__.split(".")[0] == "tf_keras"
               for klass in type(obj).__mro__)


def tf_keras_is_tf_keras():
    """Whether `tf.keras` is tf-keras: TensorFlow's own switch."""
    return os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")


def wrapper_config(optimizer, serialized_inner):
    """The config of a wrapper whose inner optimizer serialized as given."""
    return {
        "name": optimizer.name,
        "inner_optimizer": serialized_inner,
        "loss_scale": serialization.serialize(optimizer._loss_scale),  # pylint: disable=protected-access
    }


class ScaledLossProtocol:
    """The loss-scale attributes and both step protocols of a wrapper.

    The wrapper sets `_loss_scale` and `_skipped_steps`, and calls
    `_reset_protocol()` in its constructor.
    """

    # Opted-in per-step gradient statistics (`gradient_stats.attach`,
    # which `LossScaleMonitor(gradient_stats=True)` calls); None: none.
    _gradient_stats = None

    def _stats_for(self, variables):
        """What the step core records for a step over `variables`: None
        unless statistics are attached."""
        stats = self._gradient_stats
        return None if stats is None else stats.selection(variables)

    def _reset_protocol(self):
        # `fit` of Keras 3 uses the Keras 3 protocol; the TF 2.x methods
        # switch it.
        self._caller_unscales = False
        # Set by get_scaled_loss until get_unscaled_gradients is called.
        self._awaiting_unscale = False
        # Whether scale_loss or get_scaled_loss was ever called: gradients
        # applied before that come from a loss never scaled (the tf-keras
        # wrapper applies them as given, as tf-keras does).
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

    def _scale(self, loss):
        return loss_scaled_step.scale_loss(loss, self._loss_scale)

    def scale_loss(self, loss):
        """Keras 3 protocol: returns `loss * scale`; `apply_gradients` then
        takes the scaled gradients and unscales them."""
        self._caller_unscales = False
        self._awaiting_unscale = False
        self._loss_scaled = True
        return self._scale(loss)

    def get_scaled_loss(self, loss):
        """TF 2.x protocol: returns `loss * scale` in the loss's dtype.

        `loss` may be a callable returning the loss; a callable returning the
        scaled loss comes back. Unscale the gradients with
        `get_unscaled_gradients` before `apply_gradients`.
        """
        self._caller_unscales = False
        self._awaiting_unscale = True
        self._loss_scaled = True
        return self._scale(loss)

    def get_unscaled_gradients(self, grads):
        """TF 2.x protocol: returns `grads / scale`, structure and dtypes kept.

        `None` entries stay None; `tf.IndexedSlices` stay IndexedSlices.
        """
        step_arguments.check_structure(grads)
        self._caller_unscales = True
        self._awaiting_unscale = False
        return unscaling.unscale_structure(grads, self._loss_scale())

    def check_unscaled(self):
        """Raises ValueError if `get_scaled_loss` was not followed by
        `get_unscaled_gradients`: the gradients still hold the scale."""
        if self._awaiting_unscale:
            raise ValueError(
                "apply_gradients got the gradients of get_scaled_loss's loss "
                "without get_unscaled_gradients: they are still multiplied by "
                "the loss scale. Call grads = optimizer."
                "get_unscaled_gradients(grads) before apply_gradients, or use "
                "optimizer.scale_loss(loss) instead of get_scaled_loss, and "
                "apply_gradients unscales them itself.")

    def check_finite(self, grads):
        """Whether every gradient on this replica is finite (a bool tensor)."""
        return finiteness.all_finite(grads)

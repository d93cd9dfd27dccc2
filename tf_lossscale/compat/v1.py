"""`MixedPrecisionLossScaleOptimizer`: loss scaling for `tf.compat.v1.train`.

The contract, that of `tf.compat.v1.mixed_precision.
MixedPrecisionLossScaleOptimizer(opt, loss_scale)`:

* `compute_gradients(loss, ...)` differentiates `loss * scale` with the
  wrapped optimizer and returns the gradients divided by the scale, paired
  with their variables as the wrapped optimizer paired them;
* `apply_gradients(grads_and_vars, global_step=None, name=None)` takes those
  unscaled gradients, updates the loss scale from them and applies them with
  the wrapped optimizer only if every one is finite; in a graph it returns
  one `Operation` that does all of it. `global_step` is incremented (by the
  wrapped optimizer) on applied steps only; a skipped step leaves the
  variables, the slots and `global_step` as they were;
* `minimize` is `compute_gradients` then `apply_gradients`.

What differs from TensorFlow's wrapper:

* `loss_scale` is anything `tf_lossscale.get` accepts ("dynamic", a number,
  a `tf_lossscale.LossScale` with any rule arguments, a serialized loss
  scale), or one of TensorFlow's own `tf.compat.v1.mixed_precision` loss
  scales, which is used as it is, driven by its own `update`;
* a fixed scale may skip non-finite steps too
  (`FixedLossScale(v, skip_non_finite=True)`), with the finiteness flag
  agreed by every replica as for a dynamic one (`tf_lossscale.
  loss_scaled_step`, the step this class adapts); parameter-server and
  central-storage strategies are refused with a ValueError;
* gradients are unscaled by a division computed in float32 (float64 for
  float64 gradients) and cast back, so float16 gradients work;
* the wrapped optimizer is public, as `inner_optimizer` (its slots are
  there: the wrapper's own `get_slot` answers None, as TensorFlow's does);
* wrapping a loss-scaling optimizer (this one or TensorFlow's) is refused:
  the loss would be scaled twice.
"""

import tensorflow as tf

from tf_lossscale.step import loss_scaled_step
from tf_lossscale._internal import private_api
from tf_lossscale.loss_scales import serialization
from tf_lossscale._internal import step_arguments
from tf_lossscale.ops import unscaling
from tf_lossscale._internal import checks
from tf_lossscale.step import wrapper_core

__all__ = ["MixedPrecisionLossScaleOptimizer"]

_GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP


def _is_tensorflow_loss_scale(loss_scale):
    return isinstance(loss_scale, tf.compat.v1.mixed_precision.LossScale)


def _resolve_loss_scale(identifier):
    if identifier is None:
        raise ValueError(
            "loss_scale cannot be None; use 'dynamic', a number or a "
            "tf_lossscale.LossScale")
    if _is_tensorflow_loss_scale(identifier):
        return identifier
    return serialization.get_argument("loss_scale", identifier)


def _state_variables(loss_scale):
    if _is_tensorflow_loss_scale(loss_scale):
        # TensorFlow's loss scales list their variables nowhere public.
        return private_api.tf1_loss_scale_variables(loss_scale)
    return list(loss_scale.variables)


class MixedPrecisionLossScaleOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a `tf.compat.v1.train.Optimizer` with loss scaling.

    Args:
      opt: the `tf.compat.v1.train.Optimizer` to wrap. The wrapper takes its
        name and `use_locking`.
      loss_scale: anything `tf_lossscale.get` accepts ("dynamic", the
        default: `DynamicLossScale()`; a number: a `FixedLossScale`; a
        `LossScale`; a serialized loss scale), or a loss scale of
        `tf.compat.v1.mixed_precision`. Create it in the graph (and under
        the strategy's scope) the optimizer is used in.

    Raises:
      ValueError: `opt` is not a `tf.compat.v1.train.Optimizer` (as
        TensorFlow's wrapper raises) or already scales the loss, or
        `loss_scale` is None or not a loss scale identifier.
      TypeError, ValueError: `loss_scale` is a config or value
        `tf_lossscale.get` refuses (the message says `loss_scale` was).

    In a checkpoint, the wrapped optimizer is `base_optimizer` and the loss
    scale `loss_scale`, as with TensorFlow's wrapper; a `Saver` finds the
    scale's variables under the same names as TensorFlow's
    (`current_loss_scale`, `good_steps`), so its checkpoints restore.
    """

    def __init__(self, opt, loss_scale="dynamic"):
        if not isinstance(opt, tf.compat.v1.train.Optimizer):
            raise ValueError(
                "opt must be a tf.compat.v1.train.Optimizer, got "
                f"{type(opt).__name__}")
        if isinstance(opt, (MixedPrecisionLossScaleOptimizer,
                            tf.compat.v1.mixed_precision.
                            MixedPrecisionLossScaleOptimizer)):
            raise checks.DoubleScalingError(
                "opt already applies loss scaling; wrap the optimizer inside "
                "it instead, or the loss would be scaled twice")
        super().__init__(private_api.tf1_use_locking(opt), opt.get_name())
        self._optimizer = opt
        self._loss_scale = _resolve_loss_scale(loss_scale)
        private_api.track(self, opt, "base_optimizer")
        private_api.track(self, self._loss_scale, "loss_scale")

    @property
    def inner_optimizer(self):
        """The wrapped optimizer, which holds the slots."""
        return self._optimizer

    @property
    def loss_scale(self):
        """The loss scale; call it for the current scale (a float32 tensor)."""
        return self._loss_scale

    def compute_gradients(self, loss, var_list=None, gate_gradients=_GATE_OP,
                          aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None):
        """The wrapped optimizer's `compute_gradients` of `loss * scale`,
        with every gradient divided by the scale.

        `loss` is a tensor, or a callable returning it (required eagerly).
        The other arguments are passed on. Returns a list of `(gradient,
        variable)` pairs; a gradient may be None.
        """
        grads_and_vars = self._optimizer.compute_gradients(
            loss_scaled_step.scale_loss(loss, self._loss_scale),
            var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss)
        grads = [grad for grad, _ in grads_and_vars]
        variables = [variable for _, variable in grads_and_vars]
        return list(zip(unscaling.unscale(grads, self._loss_scale()),
                        variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Updates the loss scale; applies the gradients if all are finite.

        Args:
          grads_and_vars: `(gradient, variable)` pairs, the gradients
            unscaled, as `compute_gradients` returns them.
          global_step: optional variable the wrapped optimizer increments
            by one when it applies; untouched on a skipped step.
          name: optional name of the returned operation (default: the
            optimizer's name).

        Returns:
          In a graph, an `Operation` that updates the scale and applies or
          skips; eagerly, None (the step has run).

        Raises:
          checks.ReplicaContextError: (a ValueError and a RuntimeError)
            called in cross-replica context (under a strategy's scope,
            outside its `run`).
          ValueError: under a strategy loss scaling cannot support.
          TypeError, ValueError: `grads_and_vars` refused by
            `tf_lossscale._internal.step_arguments` (not pairs, none at all, a
            gradient that is not floating-point or does not fit its
            variable, every gradient None), before anything changes.
        """
        wrapper_core.open_step()
        grads, variables = step_arguments.checked_pairs(grads_and_vars)

        name = name or self.get_name()
        # TensorFlow's wrapper's name for the inner op; it frees `name`. One
        # object for all replicas: the inner optimizer's merge_call regroups
        # distinct (even equal) strings into a per-replica value.
        inner_name = name + "-wrapped"

        def apply(grads, variables):
            return self._optimizer.apply_gradients(
                list(zip(grads, variables)), global_step=global_step,
                name=inner_name)

        step = loss_scaled_step.apply_or_skip(
            self._loss_scale, grads, variables, apply, skip_record=None)
        if step is None:
            return None
        return tf.group(step, name=name)

    def get_slot(self, var, name):
        """None, as with TensorFlow's wrapper: the slots are the wrapped
        optimizer's; ask `inner_optimizer.get_slot(var, name)`.

        `tf.train.Checkpoint` collects slots from every optimizer it meets
        and refuses a slot that two of them report.
        """
        del var, name
        return None

    def get_slot_names(self):
        """[], as with TensorFlow's wrapper; see `get_slot`."""
        return []

    def variables(self):
        """The wrapped optimizer's variables in the current graph, then the
        loss scale's."""
        return self._optimizer.variables() + _state_variables(
            self._loss_scale)

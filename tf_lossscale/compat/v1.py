"""`MixedPrecisionLossScaleOptimizer`: loss scaling for `tf.compat.v1.train`
(docs/guides/tf1.md)."""

import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale._internal import private_api
from tf_lossscale.ops import replicas
from tf_lossscale.ops import unscaling
from tf_lossscale.step import loss_scaled_step
from tf_lossscale.step import optimizer_arguments

__all__ = ["MixedPrecisionLossScaleOptimizer"]

_GATE_OP = tf.compat.v1.train.Optimizer.GATE_OP
_TF_LOSS_SCALE = tf.compat.v1.mixed_precision.LossScale


class MixedPrecisionLossScaleOptimizer(tf.compat.v1.train.Optimizer):
    """Wraps a `tf.compat.v1.train.Optimizer` with loss scaling: a skipped
    step leaves the variables, the slots and `global_step` as they were.

    Args:
      opt: the `tf.compat.v1.train.Optimizer` to wrap (its name and
        `use_locking` become the wrapper's).
      loss_scale: anything `tf_lossscale.get` takes (`"dynamic"`, the
        default; a number, for a fixed scale; a `LossScale` or its config;
        a `LossScaleGroup` several optimizers share),
        or a `tf.compat.v1.mixed_precision` loss scale, used as it is. Made
        in the graph (and under the strategy's scope) the optimizer runs in.

    Raises:
      ValueError: `opt` is no `tf.compat.v1.train.Optimizer` (as TensorFlow's
        wrapper raises) or already scales the loss (`DoubleScalingError`),
        or `loss_scale` is None or refused.
      TypeError: `loss_scale` is a config of the wrong shape.
    """

    def __init__(self, opt, loss_scale="dynamic"):
        checks.inner_optimizer(
            opt, tf.compat.v1.train.Optimizer,
            (MixedPrecisionLossScaleOptimizer,
             tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer),
            "`tf.compat.v1.train.Optimizer`", argument="opt",
            error=ValueError)
        resolved = optimizer_arguments.resolve_loss_scale(
            loss_scale, own_types=_TF_LOSS_SCALE)
        super().__init__(private_api.tf1_use_locking(opt), opt.get_name())
        resolved = optimizer_arguments.claim(resolved, self)
        # Unclaimed: as with TensorFlow's wrapper, one optimizer may serve
        # several wrappers (in several graphs, say).
        self._optimizer = opt
        self._loss_scale = resolved
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
        """The wrapped optimizer's `compute_gradients` of `loss * scale`
        (`loss` a tensor, or a callable returning it), each gradient divided
        by the scale."""
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
        """Updates the loss scale from `grads_and_vars` (unscaled, as
        `compute_gradients` returns them) and applies them if all are finite
        (`global_step`, if given, counts applied steps). Returns the step's
        op named `name` in a graph, None eagerly. Raises, before anything
        changes, `ReplicaContextError` in a strategy's cross-replica context
        and TypeError or ValueError for refused pairs."""
        checks.replica_context()
        replicas.check_supported()
        grads, variables = checks.pairs(grads_and_vars)
        grads = checks.gradients(grads, variables)
        name = name or self.get_name()
        # TensorFlow's wrapper's name for the inner op; one string object
        # for every replica (merge_call regroups distinct ones).
        inner_name = name + "-wrapped"

        def apply(grads, variables):
            return private_api.tf1_apply_summed(
                self._optimizer, list(zip(grads, variables)),
                global_step=global_step, name=inner_name)

        step = loss_scaled_step.apply_or_skip(
            self._loss_scale, grads, variables, apply, skip_record=None)
        return None if step is None else tf.group(step, name=name)

    def get_slot(self, var, name):
        """None, as TensorFlow's wrapper: `inner_optimizer` has the slots
        (`tf.train.Checkpoint` refuses a slot two optimizers report)."""
        del var, name
        return None

    def get_slot_names(self):
        """[], as with TensorFlow's wrapper; see `get_slot`."""
        return []

    def variables(self):
        """The wrapped optimizer's variables in the current graph, then the
        loss scale's."""
        scale_variables = (
            private_api.tf1_loss_scale_variables(self._loss_scale)
            if isinstance(self._loss_scale, _TF_LOSS_SCALE)
            else list(self._loss_scale.variables))
        return self._optimizer.variables() + scale_variables

"""Per-step gradient statistics of `LossScaleMonitor(gradient_stats=True)`:
attached to an optimizer, they are recorded by every step traced while they
are (skipped steps included, over all replicas). Their variable is not state
(not saved, not tracked)."""

import math

import tensorflow as tf

from tf_lossscale.ops import float16
from tf_lossscale.ops import replicas


class StepGradientStats:
    """The statistics of one optimizer's steps over the gradients of the
    `watched` variables, in a variable of `strategy` (by default the current
    one)."""

    def __init__(self, watched, strategy=None):
        self._watched = {id(variable) for variable in watched}
        strategy = strategy or tf.distribute.get_strategy()
        # Made eagerly, before a step is traced with it (a tf.function may
        # create variables only on its first call).
        with tf.init_scope(), strategy.scope():
            self.values = tf.Variable(
                tf.zeros([3]), name="gradient_stats", trainable=False,
                aggregation=tf.VariableAggregation.NONE)

    def selection(self, variables):
        """What the step core writes for a step over `variables` (in the
        order of its gradients)."""
        return _Selection(self.values,
                          [id(v) in self._watched for v in variables])

    def read(self):
        """Host side (one device read): of the last recorded step, the share
        of the watched values that were zero or subnormal in float16 (0.0
        before any step, or with nothing watched), and log2(65504 / their
        largest), the doublings of the scale left before it overflows float16
        (-inf after NaN/Inf, +inf when all were 0)."""
        tiny, count, largest = (float(v) for v in self.values.numpy())
        return (tiny / count if count else 0.0,
                float16.headroom_log2(largest) if largest else math.inf)


class _Selection:
    """The watched positions among one step's gradients."""

    def __init__(self, values, mask):
        self._values = values
        self._mask = mask

    def write(self, grads, loss_scale):
        """Cross-replica context: records the stats of the step's unscaled
        `grads` (per-replica values under a strategy) at the scale it ran
        with (`loss_scale()`, before its update); returns the assign op."""
        with tf.name_scope("gradient_stats"):
            scale = loss_scale()

            def local(local_grads):
                return float16.scaled_gradient_stats(
                    [g for g, keep in zip(local_grads, self._mask) if keep],
                    scale)

            strategy = replicas.strategy_in_use()
            if strategy is None:
                return self._values.assign(local(grads))
            # Every replica's on every worker: counts summed, largest
            # magnitudes maxed (one all-gather of 3 floats a replica).
            gathered = strategy.gather(replicas.call_for_each_replica(
                lambda g: local(g)[None], grads), axis=0)
            return self._values.assign(tf.concat(
                [tf.reduce_sum(gathered[:, :2], axis=0),
                 tf.reduce_max(gathered[:, 2:], axis=0)], axis=0))


def attach(optimizer, watched, strategy=None):
    """Makes `optimizer`'s steps traced from now on record their stats;
    returns the `StepGradientStats`. Replaces any attached before."""
    stats = StepGradientStats(watched, strategy)
    # Past Keras' and TensorFlow's automatic tracking: not saved state.
    object.__setattr__(optimizer, "_gradient_stats", stats)
    return stats


def detach(optimizer):
    """Steps traced from now on record nothing."""
    object.__setattr__(optimizer, "_gradient_stats", None)

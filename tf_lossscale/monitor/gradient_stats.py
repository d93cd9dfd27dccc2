"""Per-step gradient statistics that `LossScaleMonitor(gradient_stats=True)`
attaches to the optimizer: each step traced while they are attached records
(skipped steps included, over all replicas) how many of the watched gradient
values were zero or subnormal in float16 at its loss scale, of how many, and
their largest magnitude. A step traced while nothing is attached holds none
of it. The variable holding them is not state (not saved, not tracked).
"""

import contextlib
import math

import tensorflow as tf

from tf_lossscale.ops import replicas
from tf_lossscale.ops import float16


class StepGradientStats:
    """The per-step statistics of one optimizer's steps, over the gradients
    of `watched` variables (the monitor's: those of the float16 layers),
    kept in a variable of `strategy` (a model's `distribute_strategy`)."""

    def __init__(self, watched, strategy=None):
        self._watched = {id(variable) for variable in watched}
        scope = (strategy.scope() if strategy is not None
                 else contextlib.nullcontext())
        # Made eagerly, before any step is traced with it (a tf.function may
        # create variables only on its first call).
        with tf.init_scope(), scope:
            self.values = tf.Variable(
                tf.zeros([3], tf.float32), name="gradient_stats",
                trainable=False, aggregation=tf.VariableAggregation.NONE)

    def selection(self, variables):
        """What the step core writes for a step over `variables` (in the
        order of its gradients)."""
        return _Selection(self, [id(v) in self._watched for v in variables])

    def read(self):
        """Host side (one device read): `(underflow_share, headroom_log2)`
        of the last step recorded: the share of the watched values that were
        zero or subnormal in float16 (0.0 before any step, or with nothing
        watched), and log2(65504 / the largest), the doublings of the scale
        left before it overflows float16 (-inf after NaN/Inf, +inf when all
        were 0).
        """
        tiny, count, largest = (float(v) for v in self.values.numpy())
        share = tiny / count if count else 0.0
        if largest == float("inf"):
            return share, float("-inf")
        if largest == 0.0:
            return share, float("inf")
        return share, float16.FLOAT16_MAX_LOG2 - math.log2(largest)


class _Selection:
    """The watched positions among one step's gradients."""

    def __init__(self, stats, mask):
        self._stats = stats
        self._mask = mask

    def write(self, grads, loss_scale):
        """Cross-replica context: records the stats of the step's unscaled
        `grads` (per-replica values under a strategy) at the scale it ran
        with (`loss_scale()`, before its update); returns the assign op."""
        with tf.name_scope("gradient_stats"):
            scale = loss_scale()

            def local(local_grads):
                chosen = [g for g, keep in zip(local_grads, self._mask)
                          if keep]
                return float16.scaled_gradient_stats(chosen, scale)

            strategy = replicas.strategy_in_use()
            if strategy is None:
                return self._stats.values.assign(local(grads))
            # Every replica's on every worker: counts summed, largest
            # magnitudes maxed (one all-gather of 3 floats a replica).
            gathered = strategy.gather(replicas.call_for_each_replica(
                lambda g: local(g)[None], grads), axis=0)
            return self._stats.values.assign(tf.concat(
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
    """Steps traced from now on record nothing (see `attach`)."""
    object.__setattr__(optimizer, "_gradient_stats", None)

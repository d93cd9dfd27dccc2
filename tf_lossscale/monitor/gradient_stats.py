"""Opt-in per-step gradient statistics, recorded by the step itself.

`LossScaleMonitor(gradient_stats=True)` attaches a `StepGradientStats` to
the optimizer; while it is attached, every step traced from then on writes,
in the step (skipped steps included), for the watched variables' gradients
on all replicas and workers together:

* the number of gradient values that were zero or subnormal in float16 at
  the step's loss scale, and of all values;
* the largest gradient magnitude at that scale (+inf if one was NaN/Inf).

The host reads them with one small device read (`read`). A step traced
while nothing is attached contains none of this (`apply_or_skip` gets
`stats=None`), so the option costs nothing when off; a step traced before
`attach` does not record either, which is why the monitor re-makes the
model's train function when it attaches and detaches.

The values are not state: the variable is not a checkpoint dependency, not
in the optimizer's `variables`, and is dropped on `detach`.
"""

import contextlib
import math

import tensorflow as tf

from tf_lossscale.ops import replicas
from tf_lossscale.ops import float16


class StepGradientStats:
    """The per-step statistics of one optimizer's steps.

    Args:
      watched: the variables whose gradients count (the monitor passes those
        of the layers computing in float16).
      strategy: the `tf.distribute` strategy the model's variables belong
        to (a model's `distribute_strategy`; the default one without a
        strategy), or None.
    """

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
        """The stats for a step over `variables` (in the order of its
        gradients): a `_Selection`, which the step core writes."""
        return _Selection(self, [id(v) in self._watched for v in variables])

    def read(self):
        """Host side (one device read): `(underflow_share, headroom_log2)`
        of the last step recorded.

        `underflow_share`: the share of the watched gradient values that were
        zero or subnormal in float16 at the step's loss scale (0.0 before
        any step, or with nothing watched). `headroom_log2`:
        log2(65504 / the largest of them), the number of times the scale
        could double before that value overflows float16; -inf on a step
        whose gradients held NaN or Inf, +inf when all were 0.
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
        """Cross-replica context: records the step's stats; returns the
        assignment op.

        Args:
          grads: the step's unscaled gradients, a list (per-replica values
            under a strategy) in the order the selection was made for.
          loss_scale: the step's `LossScale`, called here, before its update,
            for the scale the step ran with.
        """
        with tf.name_scope("gradient_stats"):
            scale = loss_scale()

            def local(local_grads):
                chosen = [g for g, keep in zip(local_grads, self._mask)
                          if keep]
                return float16.scaled_gradient_stats(chosen, scale)

            return self._stats.values.assign(_combined(local, grads))


def _combined(local, grads):
    """`local(grads)` of every replica on every worker, combined: counts
    summed, largest magnitudes maxed (one all-gather of 3 floats a replica).
    """
    strategy = replicas.strategy_in_use()
    if strategy is None:
        return local(grads)
    per_replica = replicas.call_for_each_replica(
        lambda g: local(g)[None], grads)
    gathered = strategy.gather(per_replica, axis=0)
    return tf.concat([tf.reduce_sum(gathered[:, :2], axis=0),
                      tf.reduce_max(gathered[:, 2:], axis=0)], axis=0)


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

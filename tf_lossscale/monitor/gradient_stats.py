"""Per-step gradient statistics of `LossScaleMonitor(gradient_stats=True)`:
attached to an optimizer, they are recorded by every step traced while they
are (skipped steps included, over all replicas: each replica's figures ride
the gradients' own all-reduce). Their variable is not state (not saved, not
tracked)."""

import math

import tensorflow as tf

from tf_lossscale.loss_scales import xla_record
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

    def measure(self, grads, loss_scale):
        """In the step's replica context (or without a strategy): this
        replica's statistics of its unscaled `grads` at the scale the step
        runs with (`loss_scale()`, before its update), as a float32 vector
        that rides the gradients' all-reduce: `[tiny, count]`, then one slot
        a replica, this replica's largest scaled magnitude in its own (the
        sum of a slot is its replica's value: the largest is a maximum)."""
        with tf.name_scope("gradient_stats"):
            tiny, count, largest = tf.unstack(float16.scaled_gradient_stats(
                [g for g, keep in zip(grads, self._mask) if keep],
                loss_scale(), xla=xla_record.in_xla_context()), num=3)
            slots, own = 1, 0
            if replicas.in_replica_context():
                context = tf.distribute.get_replica_context()
                slots = context.num_replicas_in_sync
                own = context.replica_id_in_sync_group
            # Not a product with a one-hot: +inf * 0 would be NaN.
            largest = tf.where(tf.range(slots) == own, largest, 0.0)
            return tf.concat([tf.stack([tiny, count]), largest], axis=0)

    def write(self, summed):
        """Cross-replica context: records `measure`'s vector summed over the
        replicas; returns the assign op."""
        def record(summed):
            return self._values.assign(tf.stack([
                summed[0], summed[1], tf.reduce_max(summed[2:])]))
        with tf.name_scope("gradient_stats"):
            return replicas.from_summed(record, summed)


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

"""Per-step gradient statistics of `LossScaleMonitor(gradient_stats=True)`,
recorded by the steps of the optimizer they are attached to (not state)."""

import math

import tensorflow as tf

from tf_lossscale.loss_scales import xla_record
from tf_lossscale.ops import float16
from tf_lossscale.ops import replicas


class StepGradientStats:
    """The statistics of one optimizer's steps over the gradients of the
    `watched` variables, in a variable of `strategy` (default: current)."""

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
        """What the step writes for a step over `variables`."""
        return _Selection(self.values,
                          [id(v) in self._watched for v in variables])

    def read(self):
        """Of the last recorded step (one device read): the share of watched
        values zero or subnormal in float16 (0.0 before any step), and
        log2(65504 / their largest) (-inf after NaN/Inf, +inf for all 0)."""
        tiny, count, largest = (float(v) for v in self.values.numpy())
        return (tiny / count if count else 0.0,
                float16.headroom_log2(largest) if largest else math.inf)


class _Selection:
    """The watched positions among one step's gradients."""

    def __init__(self, values, mask):
        self._values = values
        self._mask = mask

    def measure(self, grads, loss_scale):
        """In the step's replica context: this replica's statistics of its
        unscaled `grads` at `loss_scale()`, as a vector to sum over the
        replicas: `[tiny, count]`, then a slot a replica holding, in this
        replica's own, its largest scaled magnitude."""
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
        """Records `measure`'s vector summed over the replicas; returns the
        assign op."""
        def record(summed):
            return self._values.assign(tf.stack([
                summed[0], summed[1], tf.reduce_max(summed[2:])]))
        with tf.name_scope("gradient_stats"):
            return replicas.from_summed(record, summed)


def attach(optimizer, watched, strategy=None):
    """Makes `optimizer`'s steps traced from now on record their stats;
    returns the `StepGradientStats`."""
    stats = StepGradientStats(watched, strategy)
    # Past Keras' and TensorFlow's automatic tracking: not saved state.
    object.__setattr__(optimizer, "_gradient_stats", stats)
    return stats


def detach(optimizer):
    """Steps traced from now on record nothing."""
    object.__setattr__(optimizer, "_gradient_stats", None)

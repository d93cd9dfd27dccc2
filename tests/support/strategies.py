"""MirroredStrategy over logical CPU devices, safe to create many times.

Every new MirroredStrategy numbers its collective ops from the same keys, so
two strategies in one process whose all-reduces differ (group size, tensor
shapes) abort each other: "joining a group with size 4, but that group has
size 2", "Shape mismatch in the collective instance 100". Users create one
strategy per process; a test suite creates dozens. Reducing through one
device uses no collective keys, and on logical CPUs sharing one host it is
the natural choice. The collective path itself is exercised by the
multi-worker tests, each in processes of its own.
"""

import tensorflow as tf


def mirrored(num_devices):
    """A MirroredStrategy over /cpu:0 ... /cpu:{num_devices - 1}."""
    return tf.distribute.MirroredStrategy(
        [f"/cpu:{index}" for index in range(num_devices)],
        cross_device_ops=tf.distribute.ReductionToOneDevice())

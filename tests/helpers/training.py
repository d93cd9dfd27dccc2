"""What the tests train with: data, strategies, exact reads of variables.

The data: 3 float32 features, one target. Both data functions draw from
numpy's generator seeded with `seed`, inputs first, so a seed always gives the
same arrays on every machine; `batches` batches of `batch_size` examples are
drawn at once (batch b is rows `b * batch_size ... (b + 1) * batch_size - 1`).
`nan_batches` puts a NaN in the first feature of one example (`nan_row` within
the batch, -1 the last) of each batch named: NaN makes every gradient of that
batch non-finite, a skip whatever the scale. The targets are drawn or computed
before any NaN.

`mirrored` is safe to create many times: every new MirroredStrategy numbers
its collective ops from the same keys, so two strategies in one process whose
all-reduces differ abort each other ("joining a group with size 4, but that
group has size 2"). Reducing through one device uses no collective keys; the
collective path is exercised by the multi-worker tests. Imports no Keras: the
tf-keras scripts use it too.
"""

import numpy as np
import tensorflow as tf


def normal_data(batch_size, batches=1, seed=0, nan_batches=(), nan_row=0):
    """Inputs and targets drawn from N(0, 1): what a step is, not learnable."""
    rng = np.random.default_rng(seed)
    examples = batch_size * batches
    x = rng.standard_normal((examples, 3)).astype(np.float32)
    y = rng.standard_normal((examples, 1)).astype(np.float32)
    return _with_nan(x, batch_size, nan_batches, nan_row), y


def summed_data(batch_size, batches=1, seed=0, nan_batches=(), nan_row=0):
    """Inputs drawn from N(0, 1), each target the sum of its inputs: a task
    the model learns, so that its loss falls."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch_size * batches, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    return _with_nan(x, batch_size, nan_batches, nan_row), y


def _with_nan(x, batch_size, nan_batches, nan_row):
    for batch in nan_batches:
        x[batch * batch_size + nan_row % batch_size, 0] = np.nan
    return x


def mirrored(num_devices):
    """A MirroredStrategy over /cpu:0 ... /cpu:{num_devices - 1}."""
    return tf.distribute.MirroredStrategy(
        [f"/cpu:{index}" for index in range(num_devices)],
        cross_device_ops=tf.distribute.ReductionToOneDevice())


def values_of(variables):
    """Each variable's value as a numpy array of its own: a copy that a later
    assignment to the variable cannot change, compared bit for bit."""
    return [np.array(v.numpy()) for v in variables]

"""The data the Keras tests train on: 3 float32 features, one target.

Both functions draw from numpy's generator seeded with `seed`, inputs first,
so a seed always gives the same arrays on every machine; `batches` batches of
`batch_size` examples are drawn at once (batch b is rows
`b * batch_size ... (b + 1) * batch_size - 1`). `nan_batches` puts a NaN in
the first feature of one example (`nan_row` within the batch, -1 the last)
of each batch named: NaN makes every gradient of that batch non-finite, a
skip whatever the scale. The targets are drawn or computed before any NaN.
"""

import numpy as np


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

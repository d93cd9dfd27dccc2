"""Under XLA, a default `DynamicLossScale` whose state cannot be right is
refused on the device and raised at the next eager read of the scale; a
`LossScaleMonitor` reads it at every batch end (docs/guides/xla.md)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

from tests.helpers import models  # pylint: disable=g-bad-import-order
from tests.helpers import training  # pylint: disable=g-bad-import-order

pytestmark = pytest.mark.usefixtures("keras_isolation")

_BATCH_SIZE = 8


class _BatchEnds(keras.callbacks.Callback):

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


def test_monitor_alone_raises_a_refused_default_scale_at_the_first_batch_end():
    model = models.tiny_model()
    optimizer = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer, "mse", jit_compile=True)
    x, y = training.summed_data(_BATCH_SIZE, 3)
    model.fit(x, y, batch_size=_BATCH_SIZE, verbose=0, shuffle=False,
              callbacks=[tf_lossscale.LossScaleMonitor()])
    weights = training.values_of(model.weights)
    iterations = int(optimizer.iterations)
    optimizer.loss_scale.variables[0].assign(float("nan"))
    batch_ends = _BatchEnds()

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="current_loss_scale=nan"):
        model.fit(x, y, batch_size=_BATCH_SIZE, verbose=0, shuffle=False,
                  callbacks=[batch_ends, tf_lossscale.LossScaleMonitor()])

    # Raised by the monitor's read at the first batch end, not at the end of
    # fit; the refused step changed nothing.
    assert batch_ends.count == 1
    assert int(optimizer.iterations) == iterations
    for before, after in zip(weights, model.weights):
        np.testing.assert_array_equal(before, after.numpy())

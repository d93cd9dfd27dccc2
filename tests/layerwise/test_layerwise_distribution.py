"""A model scaled per layer under MirroredStrategy over two logical CPUs: the
replicas agree on every skip and every factor, a NaN in one replica's part
of the batch included."""

import numpy as np
import pytest

from tf_lossscale import layerwise
from tests.helpers import layerwise_models as models
from tests.helpers import training
from tests.helpers.training import values_of

pytestmark = pytest.mark.usefixtures("keras_isolation")


def test_replicas_agree_on_factors_and_on_a_nan_in_one_replicas_part():
    strategy = training.mirrored(2)
    # The last example of batch 3 goes to replica 1: only its gradients are
    # NaN.
    x, y = models.data(batches=4)
    x[4 * models.BATCH - 1, 0] = np.nan
    with strategy.scope():
        scaled = layerwise.scale_per_layer(models.gained_model())
    finite = 3 * models.BATCH
    scaled.fit(x[:finite], y[:finite], batch_size=models.BATCH,
               shuffle=False, verbose=0)
    weights = values_of(scaled.weights)

    scaled.fit(x[finite:], y[finite:], batch_size=models.BATCH,
               shuffle=False, verbose=0)

    assert int(scaled.optimizer.skipped_steps) == 1
    for now, then in zip(values_of(scaled.weights), weights):
        np.testing.assert_array_equal(now, then)
    for variable in scaled.non_trainable_weights:
        local = strategy.experimental_local_results(variable.value)
        assert len(local) == 2
        np.testing.assert_array_equal(local[0].numpy(), local[1].numpy())
    factors = scaled.gradient_factors()
    assert min(factors["low_1"], factors["low_2"]) >= 2.0**30, factors

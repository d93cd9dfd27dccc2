"""A model scaled per layer saved with `save_weights` (docs/guides/
per-layer-scaling.md: "Save it as any model: .keras files, save_weights,
tf.train.Checkpoint"; "The factors are variables of the model
(`gradient_factors`, `gradient_margins`, `gradient_good_steps`), saved with
its weights"): a `.weights.h5` file brings the factor state back bit for
bit, with the weights and the optimizer's state, and training goes on
alike."""

import numpy as np
import pytest

import tf_lossscale
from tf_lossscale import layerwise
from tests.helpers import layerwise_models as models
from tests.helpers.training import values_of

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _state(model):
    return (values_of(model.weights) + values_of(model.optimizer.variables)
            + [np.array(float(model.optimizer.loss_scale()))])


def _assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


def test_save_weights_restores_the_factor_state_and_training_goes_on_alike(
        tmp_path):
    x, y = models.data(batches=4, seed=1)
    scaled = layerwise.scale_per_layer(models.gained_model(),
                                       increment_period=2)
    scaled.fit(x[:2 * models.BATCH], y[:2 * models.BATCH],
               batch_size=models.BATCH, shuffle=False, verbose=0)
    factors, margins, good_steps = scaled.factor_state
    # Margins and good steps of their own in every segment (training this
    # short leaves them at 1 and alike).
    margins.assign(2.0 ** -np.arange(1, len(scaled.segments), dtype=np.float32))
    good_steps.assign(np.arange(1, len(scaled.segments), dtype=np.int64))
    saved = [v.numpy() for v in scaled.factor_state]
    assert saved[0].max() > 1.0  # The factors aligned.
    path = str(tmp_path / "scaled.weights.h5")
    scaled.save_weights(path)
    state = _state(scaled)
    target = layerwise.scale_per_layer(models.gained_model(seed=1),
                                       increment_period=2)
    target.optimizer.build(target.trainable_variables)

    target.load_weights(path)

    for now, then in zip(target.factor_state, saved):
        np.testing.assert_array_equal(now.numpy(), then)
    assert target.gradient_factors() == scaled.gradient_factors()
    _assert_same(_state(target), state)
    for model in (scaled, target):
        model.fit(x[2 * models.BATCH:], y[2 * models.BATCH:],
                  batch_size=models.BATCH, shuffle=False, verbose=0)
    _assert_same(_state(target), _state(scaled))
    for now, then in zip(target.factor_state, scaled.factor_state):
        np.testing.assert_array_equal(now.numpy(), then.numpy())


def test_the_last_segments_factor_is_one():
    # "the last segment's is 1": the top is scaled by S alone.
    x, y = models.data(batches=3)
    scaled = layerwise.scale_per_layer(models.gained_model())
    history = scaled.fit(x, y, batch_size=models.BATCH, shuffle=False,
                         verbose=0, epochs=2,
                         callbacks=[tf_lossscale.LossScaleMonitor()])
    top = scaled.segments[-1][0]
    factors = scaled.gradient_factors()
    assert list(factors) == [names[0] for names in scaled.segments]
    assert factors[top] == 1.0
    assert history.history[f"gradient_factor/{top}"] == [1.0, 1.0]
    assert max(factors.values()) > 1.0  # The others moved.


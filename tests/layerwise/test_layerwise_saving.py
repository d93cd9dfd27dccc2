"""A model scaled per layer in `.keras` files, configs and checkpoints: its
factor state comes back bit for bit, and training goes on as if never
saved."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale import layerwise
from tests.helpers import layerwise_models as models
from tests.helpers.training import values_of

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _trained(batches=3):
    x, y = models.data(batches=batches + 2, seed=1)
    scaled = layerwise.scale_per_layer(
        models.gained_model(), increment_period=2, max_factor=2.0**50)
    part = batches * models.BATCH
    scaled.fit(x[:part], y[:part], batch_size=models.BATCH, shuffle=False,
               verbose=0)
    return scaled, (x[part:], y[part:])


def _state(model):
    return (values_of(model.weights) + values_of(model.optimizer.variables)
            + [np.array(float(model.optimizer.loss_scale()))])


def _assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


def test_keras_file_restores_the_factors_and_training_goes_on_alike(tmp_path):
    scaled, (x, y) = _trained()
    path = str(tmp_path / "scaled.keras")
    scaled.save(path)

    loaded = keras.saving.load_model(path)

    assert isinstance(loaded, layerwise.LayerwiseModel)
    assert loaded.segments == scaled.segments
    assert loaded.factor_rule == scaled.factor_rule
    _assert_same(_state(loaded), _state(scaled))
    for model in (scaled, loaded):
        model.fit(x, y, batch_size=models.BATCH, shuffle=False, verbose=0)
    _assert_same(_state(loaded), _state(scaled))
    assert loaded.gradient_factors() == scaled.gradient_factors()


def test_checkpoint_restores_the_factors(tmp_path):
    scaled, _ = _trained()
    path = tf.train.Checkpoint(model=scaled,
                               optimizer=scaled.optimizer).write(
                                   str(tmp_path / "ckpt"))
    fresh = layerwise.LayerwiseModel.from_config(scaled.get_config())
    fresh.compile(tf_lossscale.LossScaleOptimizer(models.adam()), "mse")
    fresh.optimizer.build(fresh.trainable_variables)

    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(
        path).assert_consumed()

    _assert_same(_state(fresh), _state(scaled))


def test_a_file_with_an_impossible_factor_is_refused_the_factors_untouched(
        tmp_path):
    scaled = layerwise.scale_per_layer(models.gained_model())
    scaled.non_trainable_weights[0].assign([2.0, 0.0, 4.0])
    path = str(tmp_path / "bad.weights.h5")
    scaled.save_weights(path)
    target = layerwise.scale_per_layer(models.gained_model(seed=1))
    state = target.non_trainable_weights[:3]
    before = values_of(state)

    # Keras goes on loading the layers' weights and raises at the end.
    with pytest.raises(ValueError, match="gradient_factors"):
        target.load_weights(path)
    _assert_same(values_of(state), before)

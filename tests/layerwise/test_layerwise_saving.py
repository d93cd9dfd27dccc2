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

# One trained and saved model for the file's tests.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("layerwise_saving")]


def _state(model):
    return (values_of(model.weights) + values_of(model.optimizer.variables)
            + [np.array(float(model.optimizer.loss_scale()))])


def _assert_same(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


class _Saved:
    """A model trained, saved (a .keras file, a checkpoint) and trained on."""

    def __init__(self, folder, batches=3):
        x, y = models.data(batches=batches + 2, seed=1)
        model = layerwise.scale_per_layer(
            models.gained_model(), increment_period=2, max_factor=2.0**50)
        part = batches * models.BATCH
        model.fit(x[:part], y[:part], batch_size=models.BATCH,
                  shuffle=False, verbose=0)
        self.config = model.get_config()
        self.keras_file = str(folder / "scaled.keras")
        model.save(self.keras_file)
        self.checkpoint = tf.train.Checkpoint(
            model=model, optimizer=model.optimizer).write(
                str(folder / "ckpt"))
        self.state, self.factors = _state(model), model.gradient_factors()
        self.segments, self.rule = model.segments, model.factor_rule
        self.rest = (x[part:], y[part:])
        self.train_on(model)
        self.state_after = _state(model)

    def train_on(self, model):
        x, y = self.rest
        model.fit(x, y, batch_size=models.BATCH, shuffle=False, verbose=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _Saved(tmp_path_factory.mktemp("layerwise_saving"))


def test_keras_file_restores_the_factors_and_training_goes_on_alike(saved):
    loaded = keras.saving.load_model(saved.keras_file)

    assert isinstance(loaded, layerwise.LayerwiseModel)
    assert loaded.segments == saved.segments
    assert loaded.factor_rule == saved.rule
    _assert_same(_state(loaded), saved.state)
    assert loaded.gradient_factors() == saved.factors
    saved.train_on(loaded)
    _assert_same(_state(loaded), saved.state_after)


def test_checkpoint_restores_the_factors(saved):
    fresh = layerwise.LayerwiseModel.from_config(saved.config)
    fresh.compile(tf_lossscale.LossScaleOptimizer(models.adam()), "mse")
    fresh.optimizer.build(fresh.trainable_variables)

    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(
        saved.checkpoint).assert_consumed()

    _assert_same(_state(fresh), saved.state)


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

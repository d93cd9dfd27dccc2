"""A model scaled per layer in `.keras` files, configs, checkpoints and
`save_weights` files: its factor state comes back bit for bit, and training
goes on as if never saved."""

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

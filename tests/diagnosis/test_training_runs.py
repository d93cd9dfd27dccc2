"""`diagnose` measures what training computes, and touches nothing.

Its passes run the layers as `fit` does: a BatchNormalization with fresh
moving statistics normalizes by the batch's (as a training step does, not as
`predict` does), and dropout is off in both runs so that the float16 run is
compared with the same function in float32. `training=False` measures as
`predict` runs. The model's weights, moving statistics and dropout layers,
and the random state every later training step draws from, are left as they
were: a model trains after `diagnose` exactly as it would have without it.
"""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("diagnosis_training_runs")]

_SCALES = [1.0, 2.0**8, 2.0**16]


@keras.saving.register_keras_serializable("tf_lossscale_tests")
class _OwnDropout(keras.layers.Dropout):
    """A user's dropout: a subclass of Keras' under a name of its own."""


def _normalized_model(dtype="mixed_float16", dropout=0.5, seed=0,
                      dropout_class=keras.layers.Dropout):
    """Large activations a BatchNormalization brings back to ~1 in training
    (its moving statistics are fresh: in inference it leaves them large),
    then dropout (of `dropout_class`)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((8,))
    h = keras.layers.Dense(
        16, dtype=dtype, name="wide",
        kernel_initializer=keras.initializers.RandomNormal(
            stddev=300.0, seed=seed))(x)
    h = keras.layers.BatchNormalization(dtype=dtype, name="bn")(h)
    h = dropout_class(dropout, dtype=dtype, name="dropout")(h)
    h = keras.layers.Dense(4, dtype=dtype, name="logits")(h)
    out = keras.layers.Activation("softmax", dtype="float32",
                                  name="probabilities")(h)
    model = keras.Model(x, out)
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1)), loss="sparse_categorical_crossentropy")
    return model


def _data(batches=2):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((16, 8)).astype(np.float32),
             rng.integers(0, 4, 16)) for _ in range(batches)]


def _rows(report, key="layers"):
    return {row["name"]: row for row in report.as_dict()[key]}


@pytest.fixture(scope="module")
def reports():
    model = _normalized_model()
    data = _data()
    return model, data, {
        training: tf_lossscale.diagnose(model, data, scales=_SCALES,
                                        training=training, verbose=0)
        for training in (True, False)}


def test_normalization_uses_the_batch_statistics_as_fit_does(reports):
    model, data, by_mode = reports

    for training, report in by_mode.items():
        # A float32 twin of its own: a training call updates the moving
        # statistics.
        twin = _normalized_model("float32")
        twin.set_weights(model.get_weights())
        normalized = keras.Model(twin.inputs, twin.get_layer("bn").output)
        run = tf.function(lambda x, n=normalized, t=training: n(
            x, training=t))
        largest = max(float(np.abs(run(x)).max()) for x, _ in data)
        measured = _rows(report)["bn"]["activation_max_float32"]
        assert measured == pytest.approx(largest, rel=1e-5), training
    # In training the batch statistics bring them to a few units; with
    # fresh moving statistics prediction leaves them in the thousands.
    assert _rows(by_mode[True])["bn"]["activation_max_float32"] < 10
    assert _rows(by_mode[False])["bn"]["activation_max_float32"] > 100


def test_dropout_is_off_in_both_runs(reports):
    model, data, by_mode = reports
    without = _normalized_model(dropout=0.0)
    without.set_weights(model.get_weights())

    expected = tf_lossscale.diagnose(without, data, scales=_SCALES,
                                     verbose=0).as_dict()

    measured = by_mode[True].as_dict()
    assert measured["layers"] == expected["layers"]
    assert measured["variables"] == expected["variables"]
    assert model.get_layer("dropout").rate == 0.5


def _assert_diagnosed_alike(model, without, data):
    """`model`'s diagnosis has the rows of `without`'s, the same model
    without its random layers."""
    measured = tf_lossscale.diagnose(model, data, scales=_SCALES,
                                     verbose=0).as_dict()
    expected = tf_lossscale.diagnose(without, data, scales=_SCALES,
                                     verbose=0).as_dict()
    assert measured["layers"] == expected["layers"]
    assert measured["variables"] == expected["variables"]


def test_a_dropout_subclass_is_off_too(reports):
    model, data, _ = reports
    own = _normalized_model(dropout_class=_OwnDropout)
    own.set_weights(model.get_weights())
    without = _normalized_model(dropout=0.0)
    without.set_weights(model.get_weights())

    _assert_diagnosed_alike(own, without, data)
    assert own.get_layer("dropout").rate == 0.5


def _recurrent_model(dropout):
    """A float16 recurrent layer with dropout on its inputs and its state."""
    keras.utils.set_random_seed(0)
    x = keras.Input((4, 8))
    h = keras.layers.SimpleRNN(8, dropout=dropout, recurrent_dropout=dropout,
                               dtype="mixed_float16", name="rnn")(x)
    out = keras.layers.Dense(4, activation="softmax", dtype="float32",
                             name="probabilities")(h)
    model = keras.Model(x, out)
    model.compile(loss="sparse_categorical_crossentropy")
    return model


def test_recurrent_dropout_is_off_too():
    model, without = _recurrent_model(0.5), _recurrent_model(0.0)
    without.set_weights(model.get_weights())
    rng = np.random.default_rng(2)
    data = [(rng.standard_normal((16, 4, 8)).astype(np.float32),
             rng.integers(0, 4, 16))]

    _assert_diagnosed_alike(model, without, data)
    cell = model.get_layer("rnn").cell
    assert (cell.dropout, cell.recurrent_dropout) == (0.5, 0.5)


def _train_step(model, x, y):
    model.train_on_batch(x, y)
    return [w.numpy().tobytes() for w in model.weights]


def test_a_model_trains_after_diagnose_as_it_would_have_without_it():
    data = _data()
    diagnosed, untouched = _normalized_model(), _normalized_model()
    weights = [w.numpy().tobytes() for w in diagnosed.weights]
    states = (random.getstate(), np.random.get_state()[1].tobytes())

    tf_lossscale.diagnose(diagnosed, data, scales=_SCALES, verbose=0)

    # Weights and moving statistics as they were; Python's and numpy's
    # generators where they were.
    assert [w.numpy().tobytes() for w in diagnosed.weights] == weights
    assert (random.getstate(), np.random.get_state()[1].tobytes()) == states
    # Dropout draws the same masks in the next steps.
    for x, y in data:
        assert _train_step(diagnosed, x, y) == _train_step(untouched, x, y)


def test_training_must_be_a_bool():
    with pytest.raises(TypeError, match="training must be True or False, "
                       "got 'yes'"):
        tf_lossscale.diagnose(_normalized_model(), _data(1),
                              training="yes", verbose=0)

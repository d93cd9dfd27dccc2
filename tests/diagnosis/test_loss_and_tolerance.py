"""What `diagnose` measures: the loss fit trains on, regularization
included, and the advised range's top with `overflow_tolerance`.

docs/guides/float16-troubleshooting.md: "Its compiled loss is used ..., as
the mean over the batch, ..., plus its regularization losses, as `fit` adds
them"; the range's top "is the largest scale at which the backward pass
overflowed on at most `overflow_tolerance` of the batches (5%: with fewer
than 20 batches, none)"; "A batch's scales above the first one whose
backward pass overflows are not run ... (the report counts them as
overflowing)".
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

from tests.helpers import float16_models  # pylint: disable=g-bad-import-order

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("diagnosis_reports")]

_SCALES = [2.0**k for k in range(0, 33, 2)]


def _regularized(dtype):
    keras.utils.set_random_seed(0)
    x = keras.Input((float16_models.FEATURES,))
    h = keras.layers.Dense(32, activation="relu", dtype=dtype, name="hidden",
                           kernel_regularizer=keras.regularizers.L2(0.1))(x)
    out = keras.layers.Dense(1, dtype=dtype, name="out")(h)
    model = keras.Model(x, out)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_diagnosed_gradients_include_the_regularization_loss():
    model = _regularized("mixed_float16")
    data = float16_models.underflowing_data()[:2]
    report = tf_lossscale.diagnose(model, data, scales=[1.0], verbose=0)
    measured = [row["gradient_max"]
                for row in report.as_dict()["variables"]]
    twin = _regularized("float32")
    twin.set_weights(model.get_weights())

    def largest(regularized):
        largest = np.zeros(len(twin.trainable_variables))
        for x, y in data:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.mean_squared_error(
                    y, twin(x, training=True)))
                if regularized:
                    loss += tf.add_n(twin.losses)
            largest = np.maximum(largest, [
                np.abs(g).max() for g in tape.gradient(
                    loss, twin.trainable_variables)])
        return largest

    np.testing.assert_allclose(measured, largest(True), rtol=1e-5)
    # The regularization shows: the hidden kernel's gradient without it
    # is another.
    assert abs(measured[0] - largest(False)[0]) > 1e-3 * measured[0]


@pytest.fixture(scope="module")
def one_bad_batch_in_twenty():
    """20 batches of the underflowing model, batch 3 with targets 2**10
    times larger: its backward pass overflows at lower scales."""
    x = float16_models.inputs(batches=20)
    data = float16_models.batches(x, float16_models.underflowing_targets(x))
    bad_x, bad_y = data[3]
    data[3] = (bad_x, bad_y * 2.0**10)
    return float16_models.underflowing_model(keras), data


def _top(report):
    return report.loss_scale_range[1]


def _below_overflow(report, batches):
    """The scale before the lowest one on which more than `batches` of the
    batches overflow."""
    as_dict = report.as_dict()
    index = next(index for index, count in enumerate(
        as_dict["overflow_batches"]) if count > batches)
    return as_dict["scales"][index - 1]


def test_one_overflowing_batch_in_twenty_is_tolerated_at_the_top(
        one_bad_batch_in_twenty):
    model, data = one_bad_batch_in_twenty

    twenty = tf_lossscale.diagnose(model, data, steps=20, scales=_SCALES,
                                   verbose=0)
    nineteen = tf_lossscale.diagnose(model, data, steps=19, scales=_SCALES,
                                     verbose=0)
    strict = tf_lossscale.diagnose(model, data, steps=20, scales=_SCALES,
                                   overflow_tolerance=0.0, verbose=0)

    # 5% of 20 batches: one may overflow at the top; of 19: none.
    assert _top(twenty) == _below_overflow(twenty, 1)
    assert _top(nineteen) == _below_overflow(nineteen, 0)
    assert _top(strict) == _below_overflow(strict, 0)
    # The bad batch is among the 19: tolerating it raises the top.
    assert _top(twenty) > _top(nineteen) == _top(strict)


def test_scales_above_a_batchs_first_overflow_count_it_as_overflowing(
        one_bad_batch_in_twenty):
    model, data = one_bad_batch_in_twenty

    counts = tf_lossscale.diagnose(model, data, steps=20, scales=_SCALES,
                                   verbose=0).as_dict()["overflow_batches"]

    assert counts == sorted(counts)
    assert counts[-1] == 20 and 0 < counts.count(1)

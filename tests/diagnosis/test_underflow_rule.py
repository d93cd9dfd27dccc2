"""`diagnose`'s underflow rule: a variable underflows when float16 loses a
material part of its gradient, not when it loses rounding noise.

A gradient that is zero in exact arithmetic (the bias of an attention's keys:
softmax removes a shift of every logit; a bias right before a normalization)
is rounding noise in float32, and float16 flushing it costs training
nothing: the report shows its values underflowing, but neither flags it nor
lets it push the advised range up. A gradient whose values underflow and
carry its layer's gradient is flagged (`tests/diagnosis/test_diagnosis.py`).
"""

import keras
import numpy as np
import pytest

import tf_lossscale

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("underflow_rule")]

_SCALES = [2.0**k for k in range(0, 33, 2)]
_TOLERANCE = 0.01


@pytest.fixture(scope="module")
def report():
    """A small Transformer-like classifier built under mixed_float16 as
    users build it, with a Dense layer's bias right before a
    BatchNormalization; its diagnosis."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        tokens = keras.Input((8,), dtype="int32")
        h = keras.layers.Embedding(50, 16, name="embedding")(tokens)
        attended = keras.layers.MultiHeadAttention(
            2, 8, name="attention")(h, h)
        h = keras.layers.LayerNormalization(name="norm")(h + attended)
        h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
        h = keras.layers.Dense(16, name="before_bn")(h)
        h = keras.layers.BatchNormalization(name="bn")(h)
        h = keras.layers.Activation("relu", name="relu")(h)
        out = keras.layers.Dense(3, activation="softmax", dtype="float32",
                                 name="out")(h)
        model = keras.Model(tokens, out)
        model.compile("sgd", "sparse_categorical_crossentropy")
        rng = np.random.default_rng(0)
        data = [(rng.integers(0, 50, (16, 8)).astype(np.int32),
                 rng.integers(0, 3, 16)) for _ in range(2)]
        return tf_lossscale.diagnose(model, data, scales=_SCALES,
                                     underflow_tolerance=_TOLERANCE,
                                     verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _first_scale_within_tolerance(row, top):
    """The lowest probed scale from which `row`'s values underflow no more
    than at the top, within the tolerance: the advised bottom a rule
    counting values alone would give."""
    shares = row["underflow_share"]
    return next(index for index in range(top + 1)
                if shares[index] <= shares[top] + _TOLERANCE)


@pytest.mark.parametrize("variable", ["attention/key/bias", "before_bn/bias"])
def test_rounding_noise_underflowing_is_neither_flagged_nor_limits_the_range(
        report, variable):
    as_dict = report.as_dict()
    row = next(r for r in as_dict["variables"] if r["name"] == variable)
    low, high = report.loss_scale_range
    top = as_dict["scales"].index(high)

    # Zero in exact arithmetic: in float32, noise next to its layer's
    # gradient.
    assert row["gradient_norm_share"] < 1e-4
    # float16 flushes it at scale 1...
    assert row["underflow_share"][0] > 0.5
    # ... and what it loses is nothing to the layer.
    assert row["underflow_norm_share"][0] < _TOLERANCE
    assert variable not in report.underflowing_variables
    assert row["layer"] not in report.keep_in_float32
    # Counting values alone would have moved the range's bottom up to
    # where its values stop underflowing.
    assert as_dict["scales"].index(low) < _first_scale_within_tolerance(
        row, top)


def test_a_healthy_attention_model_gets_no_float32_advice(report):
    assert report.keep_in_float32 == []
    assert report.first_nonfinite_layer is None
    assert not any("Keep layer" in line for line in report.advice())


def test_the_report_shows_the_measure_for_every_float16_variable(report):
    as_dict = report.as_dict()
    text = str(report)

    for row in as_dict["variables"]:
        if row["compute_dtype"] == "float16":
            assert len(row["underflow_cost"]) == len(as_dict["scales"])
            assert row["underflow_cost"] == [
                min(values, norm) for values, norm in zip(
                    row["underflow_share"], row["underflow_norm_share"])]
            assert 0.0 <= row["gradient_norm_share"] <= 1.0
        else:
            assert row["underflow_cost"] is None
        assert row["name"] in text
    assert "carries" in text

"""`tf_lossscale.diagnose`: why a float16 run fails, measured.

On models built to fail in known ways (`tests/helpers/float16_models.py`)
the report names the cause: the layer whose outputs overflow float16, the
variables whose gradients underflow at scale 1 and a higher scale that fixes
them. Its figures are checked against the same quantities computed here, and
on the demo its advised range is checked against the scale the dynamic rule
settles at, found by running the rule. The model is left bit-identical; under
MirroredStrategy each replica's figures are combined into the figures of
the whole batch. tf-keras: `tests/scripts/tf_keras_float16_diagnosis.py`,
run in the session's tf-keras process.
"""

import json
import math
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale import demo

from tests.helpers import float16_models  # pylint: disable=g-bad-import-order
from tests.helpers import training  # pylint: disable=g-bad-import-order

# One xdist worker runs the file: its module fixtures run once.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("diagnosis_reports")]

# Fewer scales than the default where a test needs no more: CI time.
_SCALES = [2.0**k for k in range(0, 33, 2)]


# A forward pass that overflows.


@pytest.fixture(scope="module")
def overflowing():
    model = float16_models.overflowing_model(keras)
    data = float16_models.overflowing_data()
    return model, data, tf_lossscale.diagnose(model, data, scales=_SCALES)


def test_report_names_the_layer_whose_outputs_overflow(overflowing):
    _, _, report = overflowing

    assert report.first_nonfinite_layer == "boom"
    assert report.keep_in_float32[0] == "boom"
    # No loss scale helps a forward pass that overflows.
    assert report.loss_scale_range is None
    advice = report.advice()
    assert any("'boom' on" in line for line in advice)
    assert any(line.startswith("Keep layer 'boom' in float32")
               for line in advice)
    assert "<- first non-finite output" in str(report)


def test_most_of_the_model_in_float32_advises_bfloat16(overflowing,
                                                      underflowing):
    _, _, report = overflowing
    # "boom" and "after" of the three float16 layers; no scale helps.
    assert report.keep_in_float32 == ["boom", "after"]
    assert "mixed_bfloat16" in report.advice()[-1]
    assert not any("bfloat16" in line for line in underflowing[2].advice())


def test_loss_scale_follows_the_advised_range(overflowing, underflowing):
    low, high = underflowing[2].loss_scale_range
    loss_scale = underflowing[2].loss_scale()

    assert isinstance(loss_scale, tf_lossscale.DynamicLossScale)
    assert loss_scale.initial_loss_scale == max(low, high / 2)
    assert loss_scale.min_loss_scale == low
    assert loss_scale.max_loss_scale is None
    assert loss_scale.get_config() == dict(
        tf_lossscale.DynamicLossScale().get_config(),
        initial_loss_scale=max(low, high / 2), min_loss_scale=low)
    # No range: the default rule.
    assert overflowing[2].loss_scale().get_config() == (
        tf_lossscale.DynamicLossScale().get_config())


def test_activation_figures_are_the_layers_outputs(overflowing):
    model, data, report = overflowing
    rows = {row["name"]: row for row in report.as_dict()["layers"]}
    layer_outputs = keras.Model(model.inputs, [
        model.get_layer(name).output for name in ("ok", "boom")])
    twin = float16_models.float32_copy(keras, model)
    twin_outputs = keras.Model(twin.inputs, [
        layer.output for layer in twin.layers[:2]])

    float16_max = np.max([[np.abs(o).max() for o in layer_outputs(x)]
                          for x, _ in data], axis=0)
    float32_max = np.max([[np.abs(o).max() for o in twin_outputs(x)]
                          for x, _ in data], axis=0)

    assert rows["ok"]["activation_max"] == float16_max[0]
    assert rows["boom"]["activation_max"] == math.inf == float16_max[1]
    np.testing.assert_allclose(
        [rows["ok"]["activation_max_float32"],
         rows["boom"]["activation_max_float32"]], float32_max, rtol=1e-6)
    assert float32_max[1] > 65504
    assert rows["boom"]["activation_headroom_log2"] == pytest.approx(
        math.log2(65504 / float32_max[1]))
    assert rows["boom"]["nonfinite_batches"] == len(data)
    assert rows["ok"]["nonfinite_batches"] == 0


# Gradients that underflow at scale 1.


@pytest.fixture(scope="module")
def underflowing():
    model = float16_models.underflowing_model(keras)
    data = float16_models.underflowing_data()
    return model, data, tf_lossscale.diagnose(model, data)


def test_report_names_the_underflowing_variables_and_a_higher_scale(
        underflowing):
    model, _, report = underflowing
    kernel, bias = [v.path
                    for v in model.get_layer("hidden").trainable_weights]

    assert kernel in report.underflowing_variables
    low, high = report.loss_scale_range
    assert low > 1
    rows = report.as_dict()["variables"]
    scales = report.as_dict()["scales"]
    for row in rows:
        costs = row["underflow_cost"]
        # At the advised bottom, within the tolerance of the top.
        assert costs[scales.index(low)] <= costs[scales.index(high)] + 0.01
        assert costs == [min(values, norm) for values, norm in zip(
            row["underflow_share"], row["underflow_norm_share"])]
    by_name = {row["name"]: row for row in rows}
    # Nearly all of the hidden kernel's gradient values underflow at scale
    # 1, and they carry more than the tolerance of the layer's gradient.
    assert by_name[kernel]["underflow_share"][0] > 0.5
    assert by_name[kernel]["underflow_cost"][0] > 0.01
    # The bias's values underflow too, but what float16 keeps of them
    # (subnormals) leaves its layer's gradient all but whole.
    assert by_name[bias]["underflow_share"][0] > 0.5
    assert bias not in report.underflowing_variables
    assert report.first_nonfinite_layer is None
    assert report.keep_in_float32 == []
    between = f"Use a loss scale between 2^{int(math.log2(low))} and "
    assert any(line.startswith(between) for line in report.advice())


def _scaled_grads(network):
    """`(x, y, scale) -> gradients` of the scaled loss, traced as `diagnose`
    traces its passes: graph rewrites may round otherwise than eager ops."""

    @tf.function
    def grads(x, y, scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(
                y, tf.cast(network(x, training=True), tf.float32)))
            scaled = loss * scale
        return tape.gradient(scaled, network.trainable_variables)

    return lambda x, y, scale: [np.asarray(g) for g in grads(
        x, y, tf.constant(scale, tf.float32))]


def test_underflow_shares_are_counted_against_a_float32_model(underflowing):
    model, data, report = underflowing
    twin = float16_models.float32_copy(keras, model)
    model_grads, twin_grads = _scaled_grads(model), _scaled_grads(twin)
    scales = report.as_dict()["scales"]
    rows = report.as_dict()["variables"]

    layers = [row["layer"] for row in rows]
    for scale in (1.0, 2.0**8, 2.0**16):
        lost = np.zeros(len(rows))
        nonzero = np.zeros(len(rows))
        largest = np.zeros(len(rows))
        lost_squares = np.zeros(len(rows))
        squares = np.zeros(len(rows))
        for x, y in data:
            float16, float32 = model_grads(x, y, scale), twin_grads(x, y, 1.0)
            for i, (g16, g32) in enumerate(zip(float16, float32)):
                underflow = (np.abs(g16) < 2.0**-14) & (g32 != 0)
                lost[i] += np.sum(underflow)
                nonzero[i] += np.sum(g32 != 0)
                largest[i] = max(largest[i], np.abs(g32).max())
                # What underflow loses of the float32 gradient, against the
                # norm of the float32 gradient of the variable's layer.
                lost_squares[i] += np.sum(np.where(
                    underflow, g32.astype(np.float64)
                    - g16.astype(np.float64) / scale, 0.0) ** 2)
                squares[i] += np.sum(g32.astype(np.float64) ** 2)
        layer_squares = {layer: sum(q for q, l in zip(squares, layers)
                                    if l == layer) for layer in layers}
        index = scales.index(scale)
        assert [row["underflow_share"][index] for row in rows] == list(
            lost / nonzero)
        assert [row["nonzero_values"] for row in rows] == list(nonzero)
        np.testing.assert_allclose([row["gradient_max"] for row in rows],
                                   largest, rtol=1e-6)
        np.testing.assert_allclose(
            [row["underflow_norm_share"][index] for row in rows],
            [np.sqrt(q / layer_squares[layer])
             for q, layer in zip(lost_squares, layers)], rtol=1e-6)
        np.testing.assert_allclose(
            [row["gradient_norm_share"] for row in rows],
            [np.sqrt(q / layer_squares[layer])
             for q, layer in zip(squares, layers)], rtol=1e-6)


def test_advised_top_is_where_the_float16_backward_pass_overflows(
        underflowing):
    model, data, report = underflowing
    _, high = report.loss_scale_range
    overflow = report.as_dict()["overflow_batches"]
    scales = report.as_dict()["scales"]

    probe = keras.Model(model.inputs, [model.get_layer("hidden").output,
                                       model.output])

    @tf.function  # As `diagnose` traces its float16 pass.
    def grads(x, y, scale):
        with tf.GradientTape() as tape:
            outputs = probe(x)
            loss = tf.reduce_mean(keras.losses.mean_squared_error(
                y, tf.cast(outputs[1], tf.float32))) * scale
        return tape.gradient(loss, [outputs[0]] + list(
            model.trainable_variables))

    def overflows(scale):
        for x, y in data:
            if not all(np.isfinite(g).all() for g in grads(
                    x, y, tf.constant(scale, tf.float32))):
                return True
        return False

    assert not overflows(high) and overflows(2 * high)
    assert overflow[scales.index(high)] == 0
    assert overflow[scales.index(2 * high)] > 0
    # The bound read from the float32 gradients agrees to within a factor
    # of 2: the backward pass overflows where its largest value does.
    assert math.log2(high) <= report.overflow_bound_log2() < (
        math.log2(high) + 1)


# The demo: the advice agrees with the dynamic rule.


def test_on_the_demo_the_advised_range_holds_the_scale_the_rule_settles_at():
    config = demo.Config()
    features, labels = demo.synthetic_data(config)
    model = demo.build_model(config)
    inner = keras.optimizers.get(config.optimizer["class_name"])
    inner.learning_rate = config.learning_rate
    model.compile(
        optimizer=tf_lossscale.LossScaleOptimizer(
            inner, loss_scale=tf_lossscale.get(config.loss_scale)),
        loss="sparse_categorical_crossentropy")
    scales = []

    class Scales(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            scales.append(logs["loss_scale"])

    steps = config.steps
    model.fit(demo.training_dataset(features, labels, config.batch_size,
                                    steps),
              epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[tf_lossscale.LossScaleMonitor(), Scales()])
    # The rule's sawtooth over the second half of the run: it settles at
    # the bottom and overflows at the top.
    settled, tried = min(scales[steps // 2:]), max(scales[steps // 2:])
    assert tried == 2 * settled

    report = tf_lossscale.diagnose(model, demo.training_dataset(
        features, labels, config.batch_size, 8))

    low, high = report.loss_scale_range
    assert low <= settled <= high <= tried


# The model is left as it was.


def _state(model):
    return {
        "weights": [np.array(w.numpy()) for w in model.weights],
        "optimizer": [np.array(v.numpy())
                      for v in model.optimizer.variables],
        "policies": [layer.dtype_policy.name for layer in model.layers],
        "global": keras.mixed_precision.global_policy().name,
        "variables": [v.path for v in model.weights],
        "layers": [layer.name for layer in model.layers],
    }


def _assert_same_state(before, after):
    assert before.keys() == after.keys()
    for key in before:
        if key in ("weights", "optimizer"):
            assert len(before[key]) == len(after[key])
            for old, new in zip(before[key], after[key]):
                assert old.dtype == new.dtype
                assert old.tobytes() == new.tobytes()
        else:
            assert before[key] == after[key], key


@pytest.mark.parametrize("global_policy", ["float32", "mixed_float16"])
def test_diagnose_changes_nothing_in_the_model(global_policy):
    keras.mixed_precision.set_global_policy(global_policy)
    model = float16_models.underflowing_model(
        keras, optimizer=tf_lossscale.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3)))
    x = float16_models.inputs()
    model.fit(x, float16_models.underflowing_targets(x), batch_size=16,
              epochs=1, verbose=0)
    before = _state(model)

    tf_lossscale.diagnose(model, float16_models.underflowing_data(),
                          scales=[1.0, 2.0**12])

    _assert_same_state(before, _state(model))


# Under MirroredStrategy.


@pytest.fixture(scope="module")
def mirrored_reports(underflowing):
    """The underflowing model on 2 replicas and on none, same weights; the
    replicas' halves of each batch differ. On none: the `underflowing`
    report (all scales from 1: its layer rows are read at scale 1, as the
    mirrored report's are)."""
    with training.mirrored(2).scope():
        distributed = float16_models.underflowing_model(keras)
    single, data, whole = underflowing
    # Replica i gets the i-th half of each batch.
    halves = [(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
              for x, y in data for i in range(2)]
    return {
        "mirrored": tf_lossscale.diagnose(distributed, data,
                                          scales=_SCALES).as_dict(),
        "whole": whole.as_dict(),
        # Each replica's loss is half its part's mean loss, as in fit:
        # its gradients at scale s are the part's own at s / 2.
        "parts": tf_lossscale.diagnose(
            single, halves, steps=len(halves),
            scales=[s / 2 for s in _SCALES]).as_dict(),
    }


def test_layer_figures_under_mirrored_are_those_of_the_whole_batch(
        mirrored_reports):
    mirrored, whole = mirrored_reports["mirrored"], mirrored_reports["whole"]

    assert mirrored["replicas"] == 2 and whole["replicas"] == 1
    assert mirrored["layers"] == whole["layers"]
    assert mirrored["first_nonfinite_layer"] == whole[
        "first_nonfinite_layer"]


def test_variable_figures_under_mirrored_combine_every_replicas_gradients(
        mirrored_reports):
    mirrored, parts = mirrored_reports["mirrored"], mirrored_reports["parts"]
    fields = ("name", "nonzero_values", "underflow_share")

    assert [{f: row[f] for f in fields} for row in mirrored["variables"]] == [
        {f: row[f] for f in fields} for row in parts["variables"]]
    # Squares summed in another order.
    for field in ("underflow_norm_share", "underflow_cost"):
        np.testing.assert_allclose(
            [row[field] for row in mirrored["variables"]],
            [row[field] for row in parts["variables"]], rtol=1e-9, atol=0)
    # At scale 1, each replica's gradient is half its part's own.
    assert [2 * row["gradient_max"] for row in mirrored["variables"]] == [
        row["gradient_max"] for row in parts["variables"]]
    # Counted per replica: a scale overflows where some replica's part does.
    assert [bool(n) for n in mirrored["overflow_batches"]] == [
        bool(n) for n in parts["overflow_batches"]]
    assert any(mirrored["overflow_batches"])


def test_a_batch_that_does_not_split_over_the_replicas_is_refused():
    with training.mirrored(2).scope():
        model = float16_models.underflowing_model(keras)
    x = float16_models.inputs()[:15]

    with pytest.raises(ValueError, match="15 examples .* 2 replicas"):
        tf_lossscale.diagnose(
            model, [(x, float16_models.underflowing_targets(x))])


# The report's three views.


def test_dict_is_plain_json_and_the_text_holds_every_advice(underflowing):
    _, _, report = underflowing
    as_dict = report.as_dict()

    assert json.loads(json.dumps(as_dict)) == as_dict
    text = str(report)
    for line in as_dict["advice"]:
        assert f"  * {line}" in text
    for row in as_dict["variables"]:
        assert row["name"] in text
    assert as_dict["loss_scale_range"] == list(report.loss_scale_range)


def test_plot_writes_a_png(underflowing, tmp_path):
    _, _, report = underflowing
    path = tmp_path / "plots" / "float16.png"

    report.plot(path)

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(underflowing, tmp_path,
                                                 monkeypatch):
    _, _, report = underflowing
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    with pytest.raises(ImportError, match=r'tf_lossscale\[plot\]'):
        report.plot(tmp_path / "float16.png")

    assert not (tmp_path / "float16.png").exists()


# Arguments.


class _Subclassed(keras.Model):

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def _two_outputs():
    x = keras.Input((3,))
    return keras.Model(x, [keras.layers.Dense(1)(x), keras.layers.Dense(1)(x)])


def _unbuilt_sequential():
    return keras.Sequential([keras.layers.Dense(1)], name="unbuilt")


@pytest.mark.parametrize("make, kwargs, error, match", [
    (lambda: "a model", {"loss": "mse"}, TypeError,
     "model must be a Keras model, got 'a model'"),
    (_unbuilt_sequential, {"loss": "mse"}, TypeError,
     "model 'unbuilt' is not built: build it"),
    (_Subclassed, {"loss": "mse"}, TypeError, "subclassed"),
    (_two_outputs, {"loss": "mse"}, TypeError, "2 outputs"),
    (lambda: float16_models.underflowing_model(keras), {"steps": 0},
     ValueError, "steps must be a positive int64, got 0"),
    (lambda: float16_models.underflowing_model(keras), {"scales": [2.0, 1.0]},
     ValueError, r"scales must be .* increasing order, got \[2.0, 1.0\]"),
    (lambda: float16_models.underflowing_model(keras), {"scales": [0.0]},
     ValueError, "scales must be"),
    (lambda: float16_models.underflowing_model(keras),
     {"underflow_tolerance": 2}, ValueError,
     "underflow_tolerance must be <= 1, got 2"),
    (lambda: float16_models.underflowing_model(keras),
     {"overflow_tolerance": -0.5}, ValueError, "overflow_tolerance"),
    (lambda: float16_models.underflowing_model(keras), {"loss": ["mse"]},
     TypeError, "one loss"),
])
def test_bad_arguments_are_refused_naming_them(make, kwargs, error, match):
    model = make()

    with pytest.raises(error, match=match):
        tf_lossscale.diagnose(model, float16_models.underflowing_data(),
                              **kwargs)


def test_an_uncompiled_model_needs_a_loss():
    x = keras.Input((3,))
    model = keras.Model(x, keras.layers.Dense(1)(x))

    with pytest.raises(ValueError, match="loss="):
        tf_lossscale.diagnose(model, [(np.ones((2, 3)), np.ones((2, 1)))])


@pytest.mark.parametrize("data, match", [
    ([], "no batch"),
    ([np.ones((2, 8))], r"batch 0 of data must be \(x, y\)"),
])
def test_bad_data_is_refused(data, match):
    model = float16_models.underflowing_model(keras)

    with pytest.raises((TypeError, ValueError), match=match):
        tf_lossscale.diagnose(model, data)


def test_sample_weights_weight_the_loss():
    model = float16_models.underflowing_model(keras)
    x, y = float16_models.underflowing_data()[0]
    weights = np.zeros(len(x), np.float32)
    weights[:4] = 1.0

    weighted = tf_lossscale.diagnose(model, [(x, y, weights)],
                                     scales=[1.0]).as_dict()
    # Weight 0 examples contribute no gradient: as if only the first 4 were
    # there, with the sum divided by all 16 (Keras' default reduction), so
    # the gradients of the first 4's mean loss at a scale of 1/4.
    first = tf_lossscale.diagnose(model, [(x[:4], y[:4])],
                                  scales=[0.25]).as_dict()

    assert [r["gradient_max"] * 4 for r in weighted["variables"]] == (
        pytest.approx([r["gradient_max"] for r in first["variables"]]))
    assert [r["underflow_share"] for r in weighted["variables"]] == [
        r["underflow_share"] for r in first["variables"]]


# tf-keras.


def test_tf_keras_models_are_diagnosed_in_a_tf_keras_process(
        tf_keras_interpreter):
    results = tf_keras_interpreter.call(
        "tests.scripts.tf_keras_float16_diagnosis:run_all")

    assert set(results) == {
        "diagnosis_leaves_the_model_as_it_was",
        "fix_gets_underflowing_gradients_to_the_variables",
        "fix_of_a_healthy_model_changes_no_dtype",
        "fix_under_mirrored_keeps_float16_after_the_normalization",
        "monitor_logs_gradient_stats",
        "nested_block_under_the_global_policy_is_named_and_fixed",
        "overflowing_layer_is_named",
        "underflowing_variables_are_named_with_a_higher_scale",
        "under_mirrored_layer_figures_are_the_whole_batchs",
    }
    failed = {name: result for name, result in results.items()
              if result != "ok"}
    assert not failed, failed


def test_a_sequential_model_is_diagnosed_as_the_same_functional_model(
        underflowing):
    functional, data, report = underflowing
    sequential = keras.Sequential(
        [keras.Input((float16_models.FEATURES,))] + [
            keras.layers.Dense.from_config(layer.get_config())
            for layer in functional.layers[1:]], name="underflowing")
    sequential.set_weights(functional.get_weights())
    sequential.compile(loss="mse")

    as_dict = tf_lossscale.diagnose(sequential, data).as_dict()

    expected = report.as_dict()
    assert as_dict["layers"] == expected["layers"]
    for row, expected_row in zip(as_dict["variables"],
                                 expected["variables"]):
        assert row.pop("name").endswith(expected_row.pop("name"))
        assert row == expected_row
    assert as_dict["loss_scale_range"] == expected["loss_scale_range"]
    assert as_dict["keep_in_float32"] == expected["keep_in_float32"]


def test_sparse_embedding_gradients_are_compared_row_by_row():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(50, 4, dtype="mixed_float16",
                               name="embedding")(tokens)
    h = keras.layers.GlobalAveragePooling1D(dtype="mixed_float16")(h)
    out = keras.layers.Dense(1, dtype="float32", name="out")(h)
    model = keras.Model(tokens, out)
    model.compile(loss="mse")
    x = np.random.default_rng(0).integers(0, 10, (16, 5)).astype(np.int32)
    y = np.ones((16, 1), np.float32)

    report = tf_lossscale.diagnose(model, [(x, y)], scales=[1.0, 2.0**10])

    embedding = report.as_dict()["variables"][0]
    assert embedding["compute_dtype"] == "float16"
    # Only the rows of the 10 tokens used have gradients.
    assert 0 < embedding["nonzero_values"] <= 10 * 4
    assert embedding["underflow_share"][1] <= embedding["underflow_share"][0]


def test_nan_in_the_data_is_reported_as_the_datas():
    model = float16_models.underflowing_model(keras)
    data = float16_models.underflowing_data()
    x, y = data[1]
    x = x.copy()
    x[3, 2] = np.nan
    data[1] = (x, y)

    report = tf_lossscale.diagnose(model, data, scales=_SCALES)

    as_dict = report.as_dict()
    assert as_dict["input_nonfinite_batches"] == 1
    # The layers' outputs are non-finite there because the inputs are.
    assert report.first_nonfinite_layer is None
    assert report.advice()[0].startswith(
        "1 of 4 batches hold NaN or Inf in their inputs: fix the data")
    # The other batches still measure the scales.
    assert report.loss_scale_range is not None

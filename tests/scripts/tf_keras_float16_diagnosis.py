"""The float16 diagnosis and the monitor's gradient figures with tf-keras.

Not a test: `tests/diagnosis/test_diagnosis.py` runs `run_all()` in the
session's `tf_keras_interpreter` (`TF_USE_LEGACY_KERAS=1`, so `tf.keras` is
tf-keras, and the CPU split into logical devices for MirroredStrategy), which
answers `{check_name: "ok" | "<traceback>"}`. Each check compares with
results computed in this run.
"""

import math
import traceback

import numpy as np
import tensorflow as tf

import tf_lossscale
from tests.helpers import float16_models
from tests.helpers import training

keras = tf.keras
CHECKS = {}
_SCALES = [2.0**k for k in range(0, 33, 2)]


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


@check
def overflowing_layer_is_named():
    model = float16_models.overflowing_model(keras)
    report = tf_lossscale.diagnose(model, float16_models.overflowing_data(),
                                   scales=_SCALES)
    assert report.first_nonfinite_layer == "boom", report
    assert report.keep_in_float32[0] == "boom", report
    assert report.loss_scale_range is None


@check
def underflowing_variables_are_named_with_a_higher_scale():
    model = float16_models.underflowing_model(keras)
    report = tf_lossscale.diagnose(model, float16_models.underflowing_data())
    kernel = model.get_layer("hidden").trainable_weights[0].name
    assert kernel in report.underflowing_variables, report
    assert report.loss_scale_range[0] > 1, report
    assert report.keep_in_float32 == [], report
    # tf-keras computes the loss in the float16 output's dtype: the scaled
    # loss itself overflows above 65504.
    assert report.loss_scale_range[1] < 65504, report


@check
def diagnosis_leaves_the_model_as_it_was():
    model = float16_models.underflowing_model(
        keras, optimizer=tf_lossscale.LossScaleOptimizer(
            keras.optimizers.Adam(1e-3)))
    x = float16_models.inputs()
    model.fit(x, float16_models.underflowing_targets(x), batch_size=16,
              verbose=0)

    def state():
        return ([w.numpy().tobytes() for w in model.weights],
                [v.numpy().tobytes() for v in model.optimizer.variables],
                [layer.dtype_policy.name for layer in model.layers],
                keras.mixed_precision.global_policy().name)

    before = state()
    tf_lossscale.diagnose(model, float16_models.underflowing_data(),
                          scales=[1.0, 2.0**12])
    assert state() == before


@check
def under_mirrored_layer_figures_are_the_whole_batchs():
    with training.mirrored(2).scope():
        distributed = float16_models.underflowing_model(keras)
    single = float16_models.underflowing_model(keras)
    data = float16_models.underflowing_data()
    mirrored = tf_lossscale.diagnose(distributed, data,
                                     scales=_SCALES).as_dict()
    whole = tf_lossscale.diagnose(single, data, scales=_SCALES).as_dict()
    assert mirrored["replicas"] == 2
    assert mirrored["layers"] == whole["layers"]


def _policies(model):
    return {layer.name: layer.dtype_policy.name for layer in model.layers
            if not isinstance(layer, keras.layers.InputLayer)}


def _fit(model, data):
    x, y = (np.concatenate(parts) for parts in zip(*data))
    return model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                     callbacks=[tf_lossscale.LossScaleMonitor()]).history


@check
def fix_under_mirrored_keeps_float16_after_the_normalization():
    strategy = training.mirrored(2)
    with strategy.scope():
        model = float16_models.normalized_model(keras)
    variables = model.trainable_variables
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(v.shape).astype(np.float32)
             for v in variables]
    # A step of the optimizer: slots and a step count to leave alone.
    strategy.run(lambda: model.optimizer.apply_gradients(
        zip(grads, variables)))

    def state():
        return ([w.numpy().tobytes() for w in model.weights],
                [v.numpy().tobytes() for v in model.optimizer.variables()],
                model.optimizer, model.optimizer.get_config(),
                int(model.optimizer.iterations.numpy()), _policies(model),
                keras.mixed_precision.global_policy().name)

    before = state()
    data = float16_models.overflowing_data()
    report = tf_lossscale.diagnose(model, data, scales=_SCALES)
    assert report.keep_in_float32 == ["boom"], report

    fixed = report.fix(model)

    assert state() == before and before[4] == 1
    # tf-keras' LayerNormalization takes its inputs in float16: a float32
    # "boom" alone overflows there, so "norm" joins it; nothing after.
    assert _policies(fixed) == dict(_policies(model), boom="float32",
                                    norm="float32"), _policies(fixed)
    assert fixed.distribute_strategy is strategy
    history = _fit(fixed, data)
    assert history["skipped_steps"] == [0, 0], history
    assert np.isfinite(history["loss"]).all(), history


@check
def fix_gets_underflowing_gradients_to_the_variables():
    model = float16_models.underflowing_model(
        keras, optimizer=tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(0.1),
            tf_lossscale.DynamicLossScale(initial_loss_scale=1.0)))
    data = float16_models.underflowing_data()
    fixed = tf_lossscale.diagnose(model, data, scales=_SCALES).fix(model)
    twin = float16_models.float32_copy(keras, model)

    def scaled_hidden_grads(network, x, y):
        """The hidden layer's kernel and bias gradients."""
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(
                y, tf.cast(network(x, training=True), tf.float32)))
            if network is not twin:
                loss = network.optimizer.get_scaled_loss(loss)
        return [g.numpy() for g in tape.gradient(
            loss, network.trainable_variables[:2])]

    assert _policies(fixed) == _policies(model)
    scale = float(fixed.optimizer.loss_scale())
    for x, y in data:
        float32 = scaled_hidden_grads(twin, x, y)
        reached = float32[0] != 0
        assert reached.any()
        assert (np.abs(scaled_hidden_grads(model, x, y)[0][reached])
                < 2.0**-14).all()
        repaired = scaled_hidden_grads(fixed, x, y)[0]
        assert (repaired[reached] != 0).all()
        # What underflow takes is within the report's tolerance.
        assert float16_models.underflow_cost(
            repaired, float32[0], scale, float32) <= 0.01
    assert _fit(fixed, data)["skipped_steps"] == [0, 0]


@check
def fix_of_a_healthy_model_changes_no_dtype():
    model = float16_models.healthy_model(keras)
    report = tf_lossscale.diagnose(model, float16_models.overflowing_data(),
                                   scales=_SCALES)
    assert report.keep_in_float32 == [] and report.loss_scale_range

    fixed = report.fix(model)

    assert isinstance(fixed, keras.Sequential)
    assert _policies(fixed) == _policies(model)
    assert isinstance(fixed.optimizer, tf_lossscale.LossScaleOptimizer)
    assert fixed.optimizer.inner_optimizer.get_config() == (
        model.optimizer.get_config())


@check
def nested_block_under_the_global_policy_is_named_and_fixed():
    """A Sequential feed-forward block inside a functional model, built
    under the global mixed_float16 policy and left so; its first layer
    overflows float16."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        x = keras.Input((8,))
        ffn = keras.Sequential([
            keras.layers.Dense(
                16, activation="relu", name="up",
                kernel_initializer=keras.initializers.RandomNormal(
                    stddev=1e5, seed=1)),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(8, name="down")], name="ffn")
        h = keras.layers.LayerNormalization(name="outer_norm")(ffn(x))
        out = keras.layers.Dense(4, activation="softmax", dtype="float32",
                                 name="out")(h)
        model = keras.Model(x, out)
        model.compile("adam", "sparse_categorical_crossentropy")
        data = float16_models.overflowing_data()
        report = tf_lossscale.diagnose(model, data, scales=_SCALES,
                                       verbose=0)
        assert report.first_nonfinite_layer == "ffn/up", report
        assert "ffn/up" in report.keep_in_float32, report

        fixed = report.fix(model)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    block = fixed.get_layer("ffn")
    assert block.get_layer("up").compute_dtype == "float32"
    assert block.get_layer("down").compute_dtype == "float16"
    for batch, _ in data:
        assert np.isfinite(fixed(batch)).all()


@check
def monitor_logs_gradient_stats():
    model = float16_models.underflowing_model(
        keras, optimizer=tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), loss_scale=2.0**10))
    (x, y), = float16_models.underflowing_data()[:1]
    half = [v for layer in model.layers for v in layer.trainable_weights
            if layer.dtype_policy.compute_dtype == "float16"]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(
            y, model(x, training=True))) * 2.0**10
    values = np.abs(np.concatenate(
        [np.ravel(g) for g in tape.gradient(loss, half)]))
    expected = (float(np.mean(values < 2.0**-14)),
                math.log2(65504.0) - math.log2(float(values.max())))

    history = model.fit(
        x, y, batch_size=16, verbose=0,
        callbacks=[tf_lossscale.LossScaleMonitor(gradient_stats=True)])

    logged = (history.history["grad_underflow_share"][0],
              history.history["grad_headroom_log2"][0])
    assert logged == expected, (logged, expected)
    assert model.optimizer._gradient_stats is None  # pylint: disable=protected-access


def run_all():
    """Runs every check; a failing one does not keep the others from
    running."""
    assert "tf_keras" in keras.__name__, keras.__name__
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # pylint: disable=broad-except
            results[name] = traceback.format_exc()
    return results

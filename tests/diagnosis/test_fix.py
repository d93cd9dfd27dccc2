"""`Float16Diagnosis.fix`: from the diagnosis to a model that trains.

On the models of `tests/helpers/float16_models.py`: a forward pass that
overflows before a normalization gets only the layers it must in float32
and trains with no skipped step (also under MirroredStrategy); gradients that
underflow at a loss scale stuck at 1 reach the fixed model's variables; a
healthy model keeps every dtype; the original model is left bit-identical.
tf-keras: `tests/scripts/tf_keras_float16_diagnosis.py`.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

from tests.helpers import float16_models  # pylint: disable=g-bad-import-order
from tests.helpers import layerwise_models  # pylint: disable=g-bad-import-order
from tests.helpers import training  # pylint: disable=g-bad-import-order

# One xdist worker runs the file: its module fixtures run once.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("fix_reports")]

_SCALES = [2.0**k for k in range(0, 33, 2)]


def _policies(model):
    return {layer.name: layer.dtype_policy.name for layer in model.layers
            if not isinstance(layer, keras.layers.InputLayer)}


def _arrays(data):
    return tuple(np.concatenate(parts) for parts in zip(*data))


def _fit_skips(model, data, epochs=2):
    x, y = _arrays(data)
    history = model.fit(x, y, batch_size=float16_models.BATCH,
                        epochs=epochs, verbose=0,
                        callbacks=[tf_lossscale.LossScaleMonitor()])
    return history.history


# A forward pass that overflows before a normalization.


def _check_normalized_fix(model, data, report, fixed, weights):
    """`weights`: the bytes of `model`'s weights before the fix."""
    assert report.first_nonfinite_layer == "boom"
    policies = _policies(model)
    # Keras 3's LayerNormalization computes in float32 inside, so its
    # float32 inputs need nothing more; the layers after it stay float16.
    assert _policies(fixed) == dict(policies, boom="float32")
    assert fixed is not model and fixed.loss == model.loss
    assert len(weights) == len(fixed.weights)
    for old, new in zip(weights, fixed.weights):
        assert old == new.numpy().tobytes()
    for x, _ in data:
        assert np.isfinite(fixed(x)).all()
    history = _fit_skips(fixed, data)
    assert history["skipped_steps"] == [0, 0]
    assert np.isfinite(history["loss"]).all()
    assert "accuracy" in history


@functools.cache
def _stepped_normalized_fix(global_policy):
    """The normalized model after one step of its optimizer (slots and a
    step count for fix to leave alone; fit would write NaN into the
    weights: this model overflows), diagnosed and fixed under
    `global_policy`: its state before and after, the report and the fix.
    Cached: the test of the fix and the one of the original share it."""
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(global_policy)
    try:
        model = float16_models.normalized_model(keras)
        data = float16_models.overflowing_data()
        rng = np.random.default_rng(0)
        variables = model.trainable_variables
        model.optimizer.apply([
            rng.standard_normal(v.shape).astype(np.float32)
            for v in variables], variables)
        before = _state(model)
        report = tf_lossscale.diagnose(model, data, scales=_SCALES)
        fixed = report.fix(model)
        return {"model": model, "data": data, "before": before,
                "after": _state(model), "report": report, "fixed": fixed}
    finally:
        keras.mixed_precision.set_global_policy(policy)


def test_fix_keeps_float16_after_the_normalization_and_trains():
    run = _stepped_normalized_fix("float32")

    _check_normalized_fix(run["model"], run["data"], run["report"],
                          run["fixed"], run["before"]["weights"])


def test_fix_under_mirrored_trains_every_replica():
    strategy = training.mirrored(2)
    with strategy.scope():
        model = float16_models.normalized_model(keras)
    data = float16_models.overflowing_data()
    report = tf_lossscale.diagnose(model, data, scales=_SCALES)
    weights = [w.numpy().tobytes() for w in model.weights]

    fixed = report.fix(model)

    _check_normalized_fix(model, data, report, fixed, weights)

    assert fixed.distribute_strategy is strategy
    assert isinstance(fixed.optimizer, tf_lossscale.LossScaleOptimizer)
    values = fixed.get_layer("boom").kernel.value.values
    assert len(values) == 2
    assert values[0].numpy().tobytes() == values[1].numpy().tobytes()


# Gradients that underflow at a loss scale stuck at 1.


def _scaled_float16_grads(model, x, y):
    """The gradients a train step of `model` hands its optimizer, still
    scaled, as its float32 variables receive them from float16."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(
            y, tf.cast(model(x, training=True), tf.float32)))
        scaled = model.optimizer.scale_loss(loss)
    return [np.asarray(g)
            for g in tape.gradient(scaled, model.trainable_variables)]


@functools.cache
def _underflowing_fix():
    """The underflowing model with a loss scale stuck at 1, diagnosed and
    fixed. Cached: the tests of what fix refuses use its report too."""
    model = float16_models.underflowing_model(
        keras, optimizer=tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(0.1),
            tf_lossscale.DynamicLossScale(initial_loss_scale=1.0)))
    data = float16_models.underflowing_data()
    report = tf_lossscale.diagnose(model, data, scales=_SCALES)
    return model, data, report, report.fix(model)


def test_fix_gets_underflowing_gradients_to_the_variables():
    model, data, report, fixed = _underflowing_fix()

    assert _policies(fixed) == _policies(model)
    low, high = report.loss_scale_range
    assert float(fixed.optimizer.loss_scale()) == max(low, high / 2) > 1
    twin = float16_models.float32_copy(keras, model)
    scale = float(fixed.optimizer.loss_scale())
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, twin(x)))
        # The hidden layer's kernel and bias.
        float32 = [np.asarray(g) for g in tape.gradient(
            loss, twin.trainable_variables[:2])]
        reached = float32[0] != 0
        assert reached.any()
        # At scale 1 float16 flushes them to 0 or keeps a few bits of them
        # (subnormal).
        original = _scaled_float16_grads(model, x, y)[0]
        assert (np.abs(original[reached]) < 2.0**-14).all()
        # In the fixed model each one arrives, and what underflow takes is
        # within the report's tolerance.
        repaired = _scaled_float16_grads(fixed, x, y)[0]
        assert (repaired[reached] != 0).all()
        assert float16_models.underflow_cost(
            repaired, float32[0], scale, float32) <= 0.01
    assert _fit_skips(fixed, data)["skipped_steps"] == [0, 0]


# A model float16 holds.


def test_fix_of_a_healthy_model_changes_no_dtype():
    model = float16_models.healthy_model(keras)
    report = tf_lossscale.diagnose(model, float16_models.overflowing_data(),
                                   scales=_SCALES)
    assert report.keep_in_float32 == [] and report.loss_scale_range

    fixed = report.fix(model)

    assert isinstance(fixed, keras.Sequential)
    assert _policies(fixed) == _policies(model)
    assert fixed.optimizer.loss_scale.get_config() == (
        report.loss_scale().get_config())
    inner = fixed.optimizer.inner_optimizer
    assert inner is not model.optimizer and int(inner.iterations) == 0
    assert inner.get_config() == model.optimizer.get_config()


# The original is left as it was.


def _state(model):
    return {
        "weights": [w.numpy().tobytes() for w in model.weights],
        "optimizer": [v.numpy().tobytes() for v in model.optimizer.variables],
        "optimizer_object": model.optimizer,
        "optimizer_config": model.optimizer.get_config(),
        "iterations": int(model.optimizer.iterations),
        "policies": _policies(model),
        "global": keras.mixed_precision.global_policy().name,
    }


@pytest.mark.parametrize("global_policy", ["float32", "mixed_float16"])
def test_fix_leaves_the_original_as_it_was(global_policy):
    run = _stepped_normalized_fix(global_policy)

    assert run["before"]["iterations"] == 1
    assert run["before"]["global"] == global_policy
    assert run["after"] == run["before"]
    assert run["fixed"].optimizer is not run["model"].optimizer
    assert run["model"].get_layer("boom").dtype_policy.name == (
        "mixed_float16")


# What fix refuses.


class _Subclassed(keras.Model):

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


def test_fix_refuses_a_subclassed_model_naming_what_it_supports():
    _, _, report, _ = _underflowing_fix()
    model = _Subclassed()
    model(np.ones((2, 8), np.float32))

    with pytest.raises(TypeError, match="fix supports functional and "
                       "Sequential models"):
        report.fix(model)


def test_fix_refuses_another_model():
    _, _, report, _ = _underflowing_fix()

    with pytest.raises(ValueError, match="not the model this report"):
        report.fix(float16_models.overflowing_model(keras))


def test_fix_needs_a_compiled_model():
    x = keras.Input((float16_models.FEATURES,))
    model = keras.Model(x, keras.layers.Dense(1, dtype="mixed_float16")(x))
    report = tf_lossscale.diagnose(model, float16_models.underflowing_data(),
                                   loss="mse", scales=[1.0])

    with pytest.raises(ValueError, match="is not compiled"):
        report.fix(model)


def test_fix_refuses_inputs_that_hold_nan():
    model = float16_models.underflowing_model(keras)
    data = float16_models.underflowing_data()
    x, y = data[0]
    data[0] = (np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x),
               y)
    report = tf_lossscale.diagnose(model, data, scales=[1.0])

    with pytest.raises(ValueError, match="1 of 4 diagnosed batches hold NaN"
                       ".* no choice of float32 layers"):
        report.fix(model)


def test_fix_refuses_outputs_that_overflow_float32_too():
    keras.utils.set_random_seed(0)
    x = keras.Input((float16_models.FEATURES,))
    h = keras.layers.Dense(
        16, dtype="mixed_float16", name="huge",
        kernel_initializer=keras.initializers.Constant(1e38))(x)
    model = keras.Model(x, keras.layers.Dense(1, name="out")(h))
    model.compile(optimizer="sgd", loss="mse")
    report = tf_lossscale.diagnose(model, float16_models.underflowing_data(),
                                   scales=[1.0])
    assert report.keep_in_float32 == ["huge"]

    with pytest.raises(ValueError, match="layer 'huge' .* even though it "
                       "computes in float32 .* no choice of float32 layers"):
        report.fix(model)


# Per-layer scaling where no single loss scale fits.


def test_fix_per_layer_keeps_underflowing_layers_float16_and_scales_them():
    model = layerwise_models.gained_model()
    x, y = layerwise_models.data(4)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)]
    report = tf_lossscale.diagnose(model, batches, scales=_SCALES, verbose=0)
    # No single scale keeps the low layers' gradients: float32 is advised,
    # for underflow alone.
    assert report.keep_in_float32 == ["low_1", "low_2"]
    assert report.keep_in_float32_per_layer == []
    assert "report.fix(model, per_layer=True)" in report.advice()[-1]

    fixed = report.fix(model, per_layer=True)

    assert isinstance(fixed, tf_lossscale.layerwise.LayerwiseModel)
    # One boundary, where the gradients' magnitudes part (2**-38).
    assert fixed.segments == [["low_1", "low_2", "gain"], ["high", "head"]]
    # Every layer as it was (the scaled model adds its boundaries).
    assert {name: policy for name, policy in _policies(fixed).items()
            if name in _policies(model)} == _policies(model)
    fixed.fit(x, y, batch_size=8, epochs=3, verbose=0)
    # Once the factors have followed the gradients, the scaled model's
    # diagnosis finds no underflow.
    after = tf_lossscale.diagnose(fixed, batches, scales=_SCALES, verbose=0)
    assert after.keep_in_float32 == [] and after.underflowing_variables == []


def test_fix_per_layer_must_be_a_bool():
    _, _, report, _ = _underflowing_fix()

    with pytest.raises(TypeError, match="per_layer must be True or False"):
        report.fix(float16_models.underflowing_model(keras), per_layer=1)

"""`Float16Diagnosis.fix` compiles its model as the original was compiled.

docs/guides/float16-troubleshooting.md: the fixed model "is compiled with the
original's compile settings (loss, metrics, loss weights, `run_eagerly`,
`steps_per_execution`, `jit_compile`) and a `LossScaleOptimizer` around a new
inner optimizer made from the original's config (learning rate and schedule
included), with the `loss_scale()` of its own diagnosis: the report's when no
dtype changed, and a measured one where the report had none because its
forward pass was not finite."
"""

import keras
import numpy as np
import pytest

import tf_lossscale

from tests.helpers import float16_models  # pylint: disable=g-bad-import-order

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("fix_reports")]

_SCALES = [2.0**k for k in range(0, 33, 2)]


def _settings(model):
    return {key: value for key, value in model.get_compile_config().items()
            if key != "optimizer"}


@pytest.mark.parametrize("settings", [
    dict(run_eagerly=True, steps_per_execution=1, jit_compile=False),
    dict(run_eagerly=False, steps_per_execution=3, jit_compile=True),
], ids=["eager", "xla_3_steps"])
def test_fix_compiles_with_the_originals_loss_metrics_weights_and_execution(
        settings):
    model = float16_models.healthy_model(keras)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], loss_weights=0.5, **settings)
    data = float16_models.overflowing_data()[:2]
    report = tf_lossscale.diagnose(model, data, scales=_SCALES, verbose=0)

    fixed = report.fix(model)

    assert _settings(fixed) == _settings(model)
    assert _settings(fixed)["loss_weights"] == 0.5
    assert (fixed.run_eagerly, fixed.steps_per_execution) == (
        settings["run_eagerly"], settings["steps_per_execution"])
    assert bool(fixed.jit_compile) is settings["jit_compile"]
    # The same weighted loss and metric on the same data.
    x, y = (np.concatenate(part) for part in zip(*data))
    assert fixed.evaluate(x, y, verbose=0, return_dict=True) == (
        model.evaluate(x, y, verbose=0, return_dict=True))


def test_fix_makes_a_new_inner_optimizer_with_the_learning_rate_schedule():
    model = float16_models.healthy_model(keras)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.5),
                  loss="sparse_categorical_crossentropy")
    report = tf_lossscale.diagnose(
        model, float16_models.overflowing_data()[:2], scales=_SCALES,
        verbose=0)

    inner = report.fix(model).optimizer.inner_optimizer

    assert inner is not model.optimizer
    assert type(inner) is keras.optimizers.SGD
    assert inner.get_config() == model.optimizer.get_config()
    assert inner.get_config()["learning_rate"] == (
        keras.optimizers.schedules.serialize(schedule))
    # The rate follows the schedule as the new optimizer's steps go.
    inner.iterations.assign(10)
    assert float(inner.learning_rate) == float(schedule(10)) < 0.1


def _overflowing_and_underflowing_model():
    """A layer ("boom") whose outputs overflow float16 before a
    normalization, and an output kernel of ~1e-3 over tiny targets, whose
    gradients underflow at small scales: the report has no range; with
    "boom" in float32 the model has one whose bottom is above 1."""
    keras.utils.set_random_seed(0)
    x = keras.Input((float16_models.FEATURES,))
    h = keras.layers.Dense(
        16, dtype="mixed_float16", name="boom",
        kernel_initializer=keras.initializers.RandomNormal(stddev=3e4,
                                                           seed=0))(x)
    h = keras.layers.LayerNormalization(dtype="mixed_float16", name="norm")(h)
    h = keras.layers.Dense(32, activation="relu", dtype="mixed_float16",
                           name="hidden")(h)
    out = keras.layers.Dense(
        1, dtype="mixed_float16", name="out",
        kernel_initializer=keras.initializers.RandomNormal(stddev=1e-3,
                                                           seed=0))(h)
    model = keras.Model(x, out, name="both")
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_fix_of_a_report_without_range_uses_its_own_diagnosis_loss_scale():
    model = _overflowing_and_underflowing_model()
    data = float16_models.underflowing_data()[:2]
    report = tf_lossscale.diagnose(model, data, scales=_SCALES, verbose=0)
    assert report.first_nonfinite_layer == "boom"
    assert report.loss_scale_range is None

    fixed = report.fix(model)

    assert fixed.get_layer("boom").dtype_policy.name == "float32"
    measured = tf_lossscale.diagnose(fixed, data, scales=_SCALES, verbose=0)
    assert measured.loss_scale_range is not None
    assert fixed.optimizer.loss_scale.get_config() == (
        measured.loss_scale().get_config())
    # Not the report's default rule.
    assert fixed.optimizer.loss_scale.get_config() != (
        report.loss_scale().get_config())

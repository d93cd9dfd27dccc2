"""`FailureWatch` where the rest works: over `fit` compiled with XLA,
several steps per call (the two reads after each call are what the watch
needs, and the run carried on stays compiled), and under MirroredStrategy
(the fixed model and its optimizer's state live in the same strategy); each
with one loss scale and scaled per layer (the run carried on keeps its
segments)."""

import contextlib

import keras
import numpy as np
import pytest

import tf_lossscale
from tests.helpers import late_failures as late
from tests.helpers import training
from tf_lossscale import layerwise

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_reach")]


_SCALING = pytest.mark.parametrize("per_layer", [False, True],
                                   ids=["one_scale", "per_layer"])


def _compiled(strategy=None, per_layer=False, **compile_args):
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = late.logits_classifier(keras)
        model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
            keras.optimizers.Lion(0.12)),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), **compile_args)
        if per_layer:
            model = layerwise.scale_per_layer(model)
    return model


def _carried_on(model, fixed, per_layer):
    """What the run carried on keeps of `model`, with or without per-layer
    scaling."""
    assert fixed.get_layer("logits").compute_dtype == "float32"
    assert isinstance(fixed, layerwise.LayerwiseModel) is per_layer
    if per_layer:
        assert fixed.segments == model.segments


@_SCALING
def test_a_late_failure_under_xla_is_named_and_carried_on(per_layer):
    model = _compiled(per_layer=per_layer, jit_compile=True,
                      steps_per_execution=4)
    x, y = late.separable_data()
    watch = tf_lossscale.FailureWatch([(x[:late.BATCH], y[:late.BATCH])],
                                      on_failure="fix", steps=1,
                                      verbose=False)
    history = watch.fit(model, x, y, batch_size=late.BATCH, epochs=22,
                        shuffle=False, verbose=0)
    (report,) = watch.reports
    assert report.diagnosis.first_nonfinite_layer == "logits"
    # Noticed at the end of a call of 4 steps.
    assert report.step % 4 == 0
    fixed = history.model
    assert fixed.jit_compile is True
    _carried_on(model, fixed, per_layer)
    assert np.all(np.isfinite(history.history["loss"]))


@_SCALING
def test_a_late_failure_under_mirrored_strategy_is_named_and_carried_on(
        per_layer):
    strategy = training.mirrored(2)
    model = _compiled(strategy, per_layer)
    x, y = late.separable_data()
    watch = tf_lossscale.FailureWatch([(x[:late.BATCH], y[:late.BATCH])],
                                      on_failure="fix", steps=1,
                                      verbose=False)
    history = watch.fit(model, x, y, batch_size=late.BATCH, epochs=22,
                        shuffle=False, verbose=0)
    (report,) = watch.reports
    assert report.diagnosis.first_nonfinite_layer == "logits"
    fixed = history.model
    assert fixed.distribute_strategy is strategy
    _carried_on(model, fixed, per_layer)
    assert int(np.asarray(fixed.optimizer.iterations)) > int(np.asarray(
        model.optimizer.iterations))
    assert np.all(np.isfinite(history.history["loss"]))


def test_a_late_failure_with_tf_keras_is_named_and_carried_on(
        tf_keras_interpreter):
    found = tf_keras_interpreter.call(
        "tests.scripts.tf_keras_failure_watch:run")
    assert found["keras"].startswith("tf_keras")
    assert any(base.startswith("tf_keras") for base in
               found["callback_bases"])
    assert found["reports"] == 1
    assert found["first_nonfinite_layer"] == "logits"
    assert found["carried_dtype"] == "float32"
    assert found["losses_finite"]
    assert found["iterations"][0] == found["iterations"][1] > 0
    assert found["state_count"][0] == found["state_count"][1] > 1
    assert found["state_equal"]


@pytest.mark.parametrize("kind", ["legacy", "group"])
def test_a_tf_keras_custom_loop_is_carried_on_with_its_optimizers_state(
        tf_keras_interpreter, kind):
    # A legacy optimizer (OptimizerV2), and a LossScaleGroup of two.
    found = tf_keras_interpreter.call(
        "tests.scripts.tf_keras_failure_watch:run_loop", kind)
    assert found["first_nonfinite_layer"] == "logits"
    assert found["carried_dtype"] == "float32"
    assert found["classes"] == (["LegacyLossScaleOptimizer"]
                                if kind == "legacy"
                                else ["LossScaleOptimizer"] * 2)
    assert found["one_new_group"]
    settled, carried = found["scale"]
    assert carried == settled == 1024.0
    old, new = found["iterations"]
    assert new == old and min(old) > 0
    old, new = found["skipped_steps"]
    assert new == old and min(old) > 0
    assert found["state_equal"]


def test_a_healthy_run_with_a_burst_of_skips_at_the_start_is_left_alone():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = late.logits_classifier(keras)
    # Far too high a scale: the first steps overflow in a row while it
    # backs off, as a run's start often does.
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        loss_scale=tf_lossscale.DynamicLossScale(2.0**40)),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    x, y = late.separable_data()
    watch = tf_lossscale.FailureWatch([(x[:late.BATCH], y[:late.BATCH])],
                                      verbose=False)
    history = model.fit(x, y, batch_size=late.BATCH, epochs=8, shuffle=False,
                        verbose=0, callbacks=[watch])
    assert int(model.optimizer.skipped_steps) >= 10
    assert watch.reports == []
    assert "float16_failure_step" not in history.history
    assert history.history["loss"][-1] < history.history["loss"][0]

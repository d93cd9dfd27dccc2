"""`FailureWatch` where per-layer gradient scaling is involved: a model
scaled per layer that fails late is diagnosed and carried on with its
segments and factor state; a late failure whose answer is per-layer scaling
(gradients lost to underflow as the run goes on) is reported as such, and
carried on into a model scaled per layer that trains as float32 does from
the same weights.

The models: `tests/helpers/late_failures.py` (logits that overflow) and
`tests/helpers/late_underflow.py` (gradients that drift below float16).
"""

import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests.helpers import late_failures as late
from tests.helpers import late_underflow
from tests.helpers import layerwise_models
from tf_lossscale.diagnosis import carry_on

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_per_layer")]

def _state(model):
    """The factor state's values, by name."""
    return {name: np.asarray(variable) for name, variable in
            model.factor_state._asdict().items()}


# A model scaled per layer whose logits overflow late.


@pytest.fixture(scope="module")
def scaled_failure(tmp_path_factory):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = late.logits_classifier(keras)
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.Lion(0.12)), loss=keras.losses.
        SparseCategoricalCrossentropy(from_logits=True))
    scaled = tf_lossscale.layerwise.scale_per_layer(model)
    x, y = late.separable_data()
    first = [(x[i:i + late.BATCH], y[i:i + late.BATCH])
             for i in range(0, 2 * late.BATCH, late.BATCH)]
    watch = tf_lossscale.FailureWatch(
        first, on_failure="stop", steps=2, verbose=False,
        directory=tmp_path_factory.mktemp("scaled_failure"))
    scaled.fit(x, y, batch_size=late.BATCH, epochs=22, shuffle=False,
               verbose=0, callbacks=[watch])
    return scaled, watch, x, y


def test_a_model_scaled_per_layer_is_watched_and_diagnosed(scaled_failure):
    scaled, watch, _, _ = scaled_failure
    assert len(watch.reports) == 1
    report = watch.report
    # Late: after the scale had settled, well into training.
    assert report.settled_scale is not None
    assert report.step > 3 * late.STEPS_PER_EPOCH
    assert report.step == int(scaled.optimizer.iterations) + int(
        scaled.optimizer.skipped_steps)
    assert report.diagnosis.first_nonfinite_layer == "logits"
    assert "'logits'" in report.cause
    # Its factors moved from their start: there is state to carry on.
    assert _state(scaled)["good_steps"][0] > 0


def test_the_bundle_of_a_model_scaled_per_layer_shows_the_failure(
        scaled_failure):
    scaled, watch, _, _ = scaled_failure
    model, batches = tf_lossscale.watch.load_bundle(
        pathlib.Path(watch.directory) / "bundle")
    assert isinstance(model, tf_lossscale.layerwise.LayerwiseModel)
    assert model.segments == scaled.segments
    for name, value in _state(model).items():
        np.testing.assert_array_equal(value, _state(scaled)[name])
    again = tf_lossscale.diagnose(model, batches, verbose=0)
    assert again.first_nonfinite_layer == "logits"


def test_carrying_on_keeps_the_segments_and_every_state(scaled_failure):
    scaled, watch, x, y = scaled_failure
    report = watch.report
    assert report.per_layer_advised(scaled)
    before = _state(scaled)

    fixed = report.fix(scaled)

    assert isinstance(fixed, tf_lossscale.layerwise.LayerwiseModel)
    assert fixed.segments == scaled.segments
    assert fixed.get_layer("logits").compute_dtype == "float32"
    assert fixed.get_layer("hidden").compute_dtype == "float16"
    for name, value in _state(fixed).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    old, new = scaled.optimizer, fixed.optimizer
    assert int(new.iterations) == int(old.iterations)
    assert int(new.skipped_steps) == int(old.skipped_steps)
    assert float(new.loss_scale()) == report.settled_scale
    for source, target in zip(old.inner_optimizer.variables,
                              new.inner_optimizer.variables):
        np.testing.assert_array_equal(np.asarray(target), np.asarray(source))
    # The fixed model trains on: every step applied, its factors' good
    # steps counting on from the carried ones.
    applied = int(new.iterations)
    history = fixed.fit(x, y, batch_size=late.BATCH, epochs=1,
                        shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert int(new.skipped_steps) == int(old.skipped_steps)
    assert int(new.iterations) == applied + late.STEPS_PER_EPOCH
    assert _state(fixed)["good_steps"][0] == (
        before["good_steps"][0] + late.STEPS_PER_EPOCH)


def test_carrying_on_refuses_other_segments():
    model = layerwise_models.gained_model()
    one = tf_lossscale.layerwise.scale_per_layer(model, segments=["high"])
    other = tf_lossscale.layerwise.scale_per_layer(model, segments=["gain"])

    with pytest.raises(ValueError, match="segments .* not .* per-layer state"):
        carry_on.carry_scaling_state(one, other)


# A late failure whose answer is per-layer scaling.

_EPOCHS = 40  # Of 4 steps: it fails near step 124, carries on 40 more.


def _float32_twin(failed):
    """A float32 copy of the failed model, with its weights (the drifting
    gains' step counts too) and its inner optimizer's state."""
    twin = late_underflow.drifting_model(policy="float32")
    twin.set_weights(failed.get_weights())
    return late.compiled_with_state_of(
        twin, failed.optimizer.inner_optimizer, "mse")


def _low_weights(model):
    return np.concatenate([np.ravel(w) for name in ("low_1", "low_2")
                           for w in model.get_layer(name).get_weights()])


@pytest.fixture(scope="module")
def underflow_run():
    keras.mixed_precision.set_global_policy("float32")
    model = late_underflow.drifting_model()
    x, y = late_underflow.data()
    batches = [(x[i:i + late_underflow.BATCH], y[i:i + late_underflow.BATCH])
               for i in range(0, 4 * late_underflow.BATCH,
                              late_underflow.BATCH)]
    watch = tf_lossscale.FailureWatch(
        batches, on_failure="fix", steps=4, baseline=True, verbose=False,
        settle_steps=60, scale_drop_binades=4)
    history = watch.fit(model, x, y, batch_size=late_underflow.BATCH,
                        epochs=_EPOCHS, shuffle=False, verbose=0,
                        max_fixes=1)
    # `model` is left as it failed: the float32 run goes on from there.
    twin = _float32_twin(model)
    low_at_failure = _low_weights(model)
    reference = twin.fit(x, y, batch_size=late_underflow.BATCH,
                         initial_epoch=history.epoch[0], epochs=_EPOCHS,
                         shuffle=False, verbose=0)
    return dict(model=model, watch=watch, history=history, twin=twin,
                reference=reference, low_at_failure=low_at_failure)


def test_a_late_underflow_is_reported_as_per_layer_scaling(underflow_run):
    watch, model = underflow_run["watch"], underflow_run["model"]
    assert len(watch.reports) == 1
    report = watch.report
    assert report.settled_scale is not None and report.step > 60
    assert "powers of 2 below where it had settled" in report.reason
    # Healthy on the first batches, from the first weights: a range of
    # loss scales holds every gradient.
    assert report.baseline.keep_in_float32 == []
    assert report.baseline.loss_scale_range is not None
    # At the failure the low layers' gradients are lost, and only those:
    # per-layer scaling keeps them in float16.
    assert {name.split("/")[0] for name in
            report.diagnosis.underflowing_variables} == {"low_1", "low_2"}
    assert report.diagnosis.keep_in_float32_per_layer == []
    assert "per-layer scaling" in report.cause
    assert "report.fix(model, per_layer=True)" in str(report)
    assert report.per_layer_advised(model)


def test_the_run_carried_on_per_layer_trains_as_float32(underflow_run):
    history, reference = underflow_run["history"], underflow_run["reference"]
    carried = history.model
    assert isinstance(carried, tf_lossscale.layerwise.LayerwiseModel)
    # One boundary, where the gradients' magnitudes part.
    assert carried.segments == [["low_1", "low_2", "shrink"],
                                ["high", "grow", "head"]]
    assert all(layer.compute_dtype == "float16"
               for layer in carried.layers if layer.name in (
                   "low_1", "low_2", "high"))
    assert history.epoch == reference.epoch
    losses = np.array(history.history["loss"])
    expected = np.array(reference.history["loss"])
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0]
    # Alike epoch by epoch (the carried run skips a few steps while its
    # scale comes down from where it had settled), and over the last half.
    np.testing.assert_allclose(losses, expected, rtol=0.25)
    half = len(losses) // 2
    np.testing.assert_allclose(losses[half:].mean(), expected[half:].mean(),
                               rtol=0.1)
    # The low layers train again, as far as the float32 run moves them.
    start = underflow_run["low_at_failure"]
    moved = np.linalg.norm(_low_weights(carried) - start)
    expected_move = np.linalg.norm(
        _low_weights(underflow_run["twin"]) - start)
    assert 0.5 * expected_move < moved < 2 * expected_move


def test_a_custom_loop_carries_on_into_the_model_scaled_per_layer():
    model = late_underflow.drifting_model()
    x, y = late_underflow.data()
    size = late_underflow.BATCH
    batches = [(x[i:i + size], y[i:i + size])
               for i in range(0, len(x), size)]
    watch = tf_lossscale.FailureWatch(
        batches[:4], on_failure="fix", steps=4, verbose=False,
        settle_steps=60, scale_drop_binades=4)

    def step_function(model):
        optimizer = model.optimizer

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = keras.losses.mean_squared_error(
                    y, model(x, training=True))
                loss = tf.reduce_mean(loss)
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return step

    step, failed, after = step_function(model), None, []
    for _ in range(_EPOCHS):
        for x_batch, y_batch in batches[:4]:
            loss = step(x_batch, y_batch)
            if failed is not None:
                after.append((x_batch, y_batch, float(loss)))
            report = watch.after_step(model, loss)
            if report is not None:
                failed = model
                model = report.fix(model)
                step = step_function(model)

    assert failed is not None and len(watch.reports) == 1
    assert watch.reports[0].per_layer_advised(failed)
    assert isinstance(model, tf_lossscale.layerwise.LayerwiseModel)
    # Every step counted on across the fix.
    assert int(model.optimizer.iterations) + int(
        model.optimizer.skipped_steps) == _EPOCHS * 4
    # Its low segment's factor lifts their gradients into float16's range.
    assert model.gradient_factors()["low_1"] > 2.0 ** 20
    assert np.all(np.isfinite([loss for _, _, loss in after]))
    # The float32 run from the failed state, on the same batches: the low
    # layers move as far, and the losses end alike.
    twin = _float32_twin(failed)
    for x_batch, y_batch, _ in after:
        twin.train_on_batch(x_batch, y_batch)
    start = _low_weights(failed)
    moved = np.linalg.norm(_low_weights(model) - start)
    expected = np.linalg.norm(_low_weights(twin) - start)
    assert 0.5 * expected < moved < 2 * expected
    x_eval, y_eval = x[:4 * size], y[:4 * size]
    np.testing.assert_allclose(
        model.evaluate(x_eval, y_eval, verbose=0),
        twin.evaluate(x_eval, y_eval, verbose=0), rtol=0.15)

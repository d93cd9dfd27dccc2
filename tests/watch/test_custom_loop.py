"""`FailureWatch.after_step` in a custom training loop: the default raises
`Float16FailureError` with the report as its message; `report.fix(model)`
gives a model whose optimizer holds the failed one's state, and the loop
goes on with it. The report names the cause, saves its files, and its
`fix` refuses what it cannot carry on."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests.helpers import late_failures as late

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_custom_loop")]


def _step_function(model):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = model.optimizer

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = late.logits_classifier(keras)
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.Lion(0.12)), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    x, y = late.separable_data()
    batches = [(x[i:i + late.BATCH], y[i:i + late.BATCH])
               for i in range(0, late.EXAMPLES, late.BATCH)]
    log_dir = tmp_path_factory.mktemp("logs")
    watch = tf_lossscale.FailureWatch(batches[:2], steps=2, log_dir=log_dir)
    step = _step_function(model)
    with pytest.raises(tf_lossscale.Float16FailureError) as raised:
        for epoch in range(40):
            for x_batch, y_batch in batches:
                watch.after_step(model, step(x_batch, y_batch))
    return model, raised.value, batches, log_dir


def test_the_error_carries_the_report_and_names_the_layer(failed):
    model, error, _, _ = failed
    report = error.report
    assert str(error) == str(report)
    assert "'logits'" in str(error)
    assert report.diagnosis.first_nonfinite_layer == "logits"
    # Every step, applied (the optimizer's iterations) or skipped.
    assert report.step == int(model.optimizer.iterations) + int(
        model.optimizer.skipped_steps)


def test_fix_carries_the_optimizer_state_over(failed):
    model, error, _, _ = failed
    report = error.report
    fixed = report.fix(model)
    old, new = model.optimizer, fixed.optimizer
    assert fixed.get_layer("logits").compute_dtype == "float32"
    assert int(new.iterations) == int(old.iterations)
    assert int(new.skipped_steps) == int(old.skipped_steps)
    for source, target in zip(old.inner_optimizer.variables,
                              new.inner_optimizer.variables):
        np.testing.assert_array_equal(target.numpy(), source.numpy())
    for source, target in zip(model.weights, fixed.weights):
        np.testing.assert_array_equal(target.numpy(), source.numpy())
    assert float(new.loss_scale()) == report.settled_scale
    assert new.loss_scale.get_config() == old.loss_scale.get_config()


def test_the_loop_goes_on_with_the_fixed_model(failed):
    model, error, batches, _ = failed
    fixed = error.report.fix(model)
    step = _step_function(fixed)
    watch = tf_lossscale.FailureWatch(batches[:2])
    skipped = int(fixed.optimizer.skipped_steps)
    losses = []
    for x_batch, y_batch in batches * 2:
        losses.append(float(step(x_batch, y_batch)))
        assert watch.after_step(fixed, losses[-1]) is None
    assert np.all(np.isfinite(losses))
    assert int(fixed.optimizer.skipped_steps) == skipped


def test_the_report_is_written_for_tensorboard(failed):
    _, error, _, log_dir = failed
    texts = [(event.step, value.tensor.string_val[0].decode())
             for path in log_dir.iterdir()
             for event in tf.compat.v1.train.summary_iterator(str(path))
             for value in event.summary.value
             if value.tag == "float16_failure"]
    assert texts == [(error.report.step, str(error.report))]


def test_fix_continues_at_the_scale_given(failed):
    model, error, _, _ = failed
    scale = error.report.settled_scale / 4
    fixed = error.report.fix(model, scale=scale)
    assert float(fixed.optimizer.loss_scale()) == scale
    assert int(fixed.optimizer.iterations) == int(model.optimizer.iterations)


def test_fix_refuses_a_model_without_a_tf_lossscale_optimizer(failed):
    _, error, _, _ = failed
    # The model diagnosed, layer for layer, compiled with a plain optimizer.
    plain = late.logits_classifier(keras)
    plain.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="carrying a run on needs a model "
                       "compiled with a tf_lossscale.LossScaleOptimizer"):
        error.report.fix(plain)


def test_fix_refuses_optimizers_for_a_model_in_no_group(failed):
    model, error, _, _ = failed
    with pytest.raises(ValueError, match="optimizers is for an optimizer in "
                       "a LossScaleGroup"):
        error.report.fix(model, optimizers=[model.optimizer])


def test_the_report_saved_without_a_model_has_no_bundle(failed, tmp_path):
    _, error, _, _ = failed
    path = error.report.save(tmp_path / "report")
    assert (path / "report.txt").read_text() == str(error.report) + "\n"
    saved = json.loads((path / "report.json").read_text())
    assert (saved["step"], saved["cause"]) == (error.report.step,
                                                error.report.cause)
    assert not (path / "bundle").exists()


def test_a_bundle_that_cannot_be_written_warns_and_the_report_is_saved(
        failed, tmp_path):
    model, error, _, _ = failed
    (tmp_path / "bundle").write_text("a file where the bundle would go")
    with pytest.warns(UserWarning, match="reproduction bundle could not be "
                      "saved"):
        error.report.save(tmp_path, model)
    assert (tmp_path / "report.txt").read_text() == str(error.report) + "\n"


def test_load_bundle_of_a_directory_without_one_says_so(tmp_path):
    with pytest.raises(ValueError, match="holds no bundle"):
        tf_lossscale.watch.load_bundle(tmp_path)


def _report(failed, diagnosis):
    """The failure's report, with another diagnosis."""
    report = failed[1].report
    return tf_lossscale.FailureReport(
        step=report.step, reason=report.reason, scale=report.scale,
        settled_scale=report.settled_scale,
        skipped_steps=report.skipped_steps, diagnosis=diagnosis,
        baseline=None, batches=report.batches)


def test_the_cause_is_the_data_when_the_diagnosed_inputs_hold_nan(failed):
    model, _, batches, _ = failed
    x, y = batches[0]
    x = x.copy()
    x[0, 0] = np.nan
    report = _report(failed, tf_lossscale.diagnose(model, [(x, y)],
                                                   verbose=0))
    assert report.cause == "the inputs hold NaN or Inf"
    assert "Cause: the inputs hold NaN or Inf." in str(report)


def test_the_cause_of_batches_that_run_healthy_says_to_pass_the_failing_ones(
        failed):
    model, error, batches, _ = failed
    # The fixed model keeps the overflowing layer in float32.
    fixed = error.report.fix(model)
    report = _report(failed, tf_lossscale.diagnose(fixed, batches[:1],
                                                   verbose=0))
    assert report.cause.startswith("no layer overflows on the diagnosed "
                                   "batches")


def test_the_cause_of_a_backward_pass_that_overflows_at_every_scale(failed):
    _, _, batches, _ = failed
    keras.mixed_precision.set_global_policy("mixed_float16")
    fresh = late.logits_classifier(keras)
    fresh.compile(loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    report = _report(failed, tf_lossscale.diagnose(
        fresh, batches[:1], scales=[2.0**40], verbose=0))
    assert report.diagnosis.first_nonfinite_layer is None
    assert report.cause == ("the float16 backward pass overflows at every "
                            "loss scale probed")

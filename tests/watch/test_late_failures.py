"""Float16 runs that fail late, after their weights moved: `FailureWatch`
notices each, its report names the layer that really overflows (found here
from a float32 twin's values), a diagnosis of the first batches called the
model healthy, and the run carried on with the fixed model trains as a
float32 run from the same weights and optimizer state does.

The models and why they fail: `tests/helpers/late_failures.py`. Each run is
a few hundred steps of a tiny model on one CPU.
"""

import json

import keras
import numpy as np
import pytest

import tf_lossscale
from tests.helpers import late_failures as late
from tf_lossscale.ops import float16

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_late_failures")]


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _watched_run(build, data, learning_rate, epochs, fix_horizon,
                 directory):
    """Trains `build`'s model under mixed_float16, watched with
    on_failure="fix"; returns the watch, the last History (the run carried
    on) and the data."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = build(keras)
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.Lion(learning_rate)), loss=_loss())
    x, y = data
    first = [(x[i:i + late.BATCH], y[i:i + late.BATCH])
             for i in range(0, 2 * late.BATCH, late.BATCH)]
    watch = tf_lossscale.FailureWatch(first, on_failure="fix", steps=2,
                                      baseline=True, directory=directory,
                                      fix_horizon=fix_horizon, verbose=False)
    history = watch.fit(model, x, y, batch_size=late.BATCH, epochs=epochs,
                        shuffle=False, verbose=0, max_fixes=1)
    return watch, history, data


def _float32_twin(build, failed):
    """A float32 copy of the model saved at the failure, with its weights
    and its inner optimizer's state."""
    keras.mixed_precision.set_global_policy("float32")
    twin = build(keras)
    twin.set_weights(failed.get_weights())
    return late.compiled_with_state_of(
        twin, failed.optimizer.inner_optimizer, _loss())


# The model, its data, Lion's learning rate, epochs of 16 steps (a few more
# than it takes to fail) and the fix's horizon: the residual stream grows
# exponentially, block over block, so the blocks below the one that
# overflows follow soon; a horizon of as many steps again fixes them at once.
_CASES = {
    "logits": (late.logits_classifier, late.separable_data, 0.12, 22, 0.25),
    "residual": (late.residual_mlp, late.linear_data, 0.003, 10, 1.0),
    "attention": (late.attention_classifier, late.token_data, 0.01, 16,
                  0.25),
}


@pytest.fixture(scope="module", params=list(_CASES))
def run(request, tmp_path_factory):
    build, data, learning_rate, epochs, horizon = _CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    watch, history, data = _watched_run(build, data(), learning_rate, epochs,
                                        horizon, directory)
    failed, _ = tf_lossscale.watch.load_bundle(directory / "bundle")
    twin = _float32_twin(build, failed)
    x, y = data
    reference = twin.fit(x, y, batch_size=late.BATCH, shuffle=False,
                         verbose=0, initial_epoch=history.epoch[0],
                         epochs=epochs)
    return dict(name=request.param, watch=watch, history=history, x=x,
                epochs=epochs,
                twin_at_failure=_float32_twin(build, failed),
                directory=directory, reference=reference)


def test_the_run_fails_late_and_once(run):
    reports = run["watch"].reports
    assert len(reports) == 1
    # Late: after the scale had settled, well into training.
    assert reports[0].settled_scale is not None
    assert 3 * late.STEPS_PER_EPOCH < reports[0].step < (
        run["epochs"] * late.STEPS_PER_EPOCH)


def test_a_diagnosis_of_the_first_batches_called_it_healthy(run):
    baseline = run["watch"].reports[0].baseline
    assert baseline.first_nonfinite_layer is None
    assert baseline.keep_in_float32 == []
    assert baseline.loss_scale_range is not None


def test_the_report_names_the_layer_that_overflows(run):
    report = run["watch"].reports[0]
    x = run["x"][:2 * late.BATCH]
    twin = run["twin_at_failure"]
    if run["name"] == "attention":
        # Its outputs stay small: the attention logits inside overflow.
        assert late.first_layer_beyond_float16(keras, twin, x) is None
        assert late.attention_logits(twin, x) > float16.FLOAT16_MAX
        expected = "attention"
    else:
        expected = late.first_layer_beyond_float16(keras, twin, x)
    assert expected is not None
    assert report.diagnosis.first_nonfinite_layer == expected
    assert repr(expected) in report.cause
    assert expected in report.diagnosis.keep_in_float32
    # The layer grew since the baseline, by more than float16 had left.
    headroom = {row["name"]: row["activation_headroom_log2"]
                for row in report.baseline.as_dict()["layers"]}
    if run["name"] != "attention":
        assert report.growth()[expected] > headroom[expected]


def test_the_run_carried_on_trains_as_float32_does(run):
    carried = run["history"]
    model = carried.model
    assert model is not None
    losses = np.array(carried.history["loss"])
    reference = np.array(run["reference"].history["loss"])
    assert carried.epoch == run["reference"].epoch
    assert np.all(np.isfinite(losses))
    # The fixed layers compute in float32, the rest in float16: the runs
    # part by float16's rounding only, which grows with the steps (the
    # runs are unstable by design): alike over the first epoch, and never
    # worse than float32 after it.
    np.testing.assert_allclose(losses[0], reference[0], rtol=0.25, atol=0.05)
    assert np.all(losses <= reference * 1.25 + 0.05)
    assert int(model.optimizer.skipped_steps) - run["watch"].reports[
        0].skipped_steps <= 2


def test_the_saved_report_and_bundle_show_the_failure_again(run):
    directory = run["directory"]
    report = run["watch"].reports[0]
    text = (directory / "report.txt").read_text()
    assert f"step {report.step}" in text and report.cause in text

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    saved = json.loads((directory / "report.json").read_text(),
                       parse_constant=refuse)
    assert (saved["step"], saved["cause"]) == (report.step, report.cause)
    assert saved["diagnosis"]["first_nonfinite_layer"] == (
        report.diagnosis.first_nonfinite_layer)
    model, batches = tf_lossscale.watch.load_bundle(directory / "bundle")
    again = tf_lossscale.diagnose(model, batches, verbose=0)
    assert again.first_nonfinite_layer == (
        report.diagnosis.first_nonfinite_layer)

"""The failure watch on a model nobody here wrote: keras.applications'
MobileNetV2 (`tests/helpers/model_zoo.py`), built as users build it (the
global `mixed_float16` policy), trains healthy under `FailureWatch`; from
step PLANT_STEP on its first convolution's kernel is PLANT_FACTOR times
larger (a callback multiplies it: a planted late growth standing in for the
real one), so that the float16 output of that convolution overflows. The
watch notices after PLANT_STEP, its report names the layer (found here from
a float32 copy's values), and the run carried on with the fixed model
(`on_failure="fix"`, `watch.fit`) trains as a float32 copy from the same
weights and optimizer state does.
"""

import keras
import numpy as np
import pytest

import tf_lossscale
from tests.helpers import late_failures
from tests.helpers import model_zoo

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_zoo_late_failure"),
              pytest.mark.at_scale]

STEPS_PER_EPOCH = model_zoo.BATCHES
PLANT_STEP = 4 * STEPS_PER_EPOCH
"""Batches trained healthy before the kernel grows (the step counts from 1:
the first step of the planted weights is PLANT_STEP + 1)."""
PLANT_FACTOR = model_zoo.HUGE_INPUT_FACTOR
"""The kernel's growth: its outputs, a few units at the start, pass
float16's 65504 (checked by test_the_report_names_the_first_convolution)."""
EPOCHS = 7
"""PLANT_STEP + 3 epochs: the failing epoch, carried on, and two more."""
CARRY_ON_SETTLE = 3
"""Steps of the run carried on in which the scale, started again where it
had settled, may still skip."""
LOSS_TOLERANCE = model_zoo.LOSS_TOLERANCE
"""The zoo judge's (`model_zoo.trains_like_float32`): a loss of the run
carried on may differ from the float32 copy's by this fraction of the float32
copy's first loss. Compared: the epoch right after the fix (the steps that
start from the same state) and the last one (where the runs end up).
Measured on this machine, as that fraction: first epoch 3.3% (TF 2.21 /
Keras 3.15) and 12.7% (TF 2.16 / Keras 3.10), last 1.8% and 5.6%. The
epoch between is left out: batch normalization on batches of 8 makes the
loss jump, in float32 as in float16 (TF 2.16's float32 copy went 1.65, 0.71,
0.63 and the run carried on 1.44, 1.25, 0.54). A run that does not learn
stays near its first loss, more than 50% of it above the float32 copy's
last."""


class _Plant(keras.callbacks.Callback):
    """Multiplies `layer`'s kernel by `factor` before step `step` + 1, once
    (`fit` called again on the fixed model does not plant it again)."""

    def __init__(self, layer, factor, step):
        super().__init__()
        self.layer, self.factor, self.step = layer, factor, step
        self.seen, self.planted = 0, False

    def on_train_batch_begin(self, batch, logs=None):
        if self.seen == self.step and not self.planted:
            kernel = self.model.get_layer(self.layer).kernel
            kernel.assign(kernel * self.factor)
            self.planted = True
        self.seen += 1


class _Record(keras.callbacks.Callback):
    """The wrapper's skipped steps after each batch, per `fit` call."""

    def __init__(self):
        super().__init__()
        self.skipped = []

    def on_train_begin(self, logs=None):
        self.skipped.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.skipped[-1].append(int(self.model.optimizer.skipped_steps))


def _float32_copy(weights, inner):
    """MobileNetV2 in float32 with `weights` and the state of `inner` (the
    failed run's inner optimizer)."""
    twin = model_zoo.mobilenet_v2(keras, policy="float32")
    twin.set_weights(weights)
    return late_failures.compiled_with_state_of(twin, inner, twin.loss)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    policy = keras.mixed_precision.global_policy()
    try:
        directory = tmp_path_factory.mktemp("zoo_late_failure")
        model = model_zoo.mobilenet_v2(keras)  # mixed_float16, as users do
        data = model_zoo.image_data(0)
        x = np.concatenate([b[0] for b in data])
        y = np.concatenate([b[1] for b in data])
        watch = tf_lossscale.FailureWatch(
            data[:1], on_failure="fix", steps=1, baseline=True, settle_steps=4,
            directory=directory, fix_horizon=0, verbose=False)
        plant, record = _Plant("Conv1", PLANT_FACTOR, PLANT_STEP), _Record()
        history = watch.fit(model, x, y, batch_size=model_zoo.IMAGE_BATCH,
                            epochs=EPOCHS, shuffle=False, verbose=0,
                            callbacks=[plant, record], max_fixes=1)
        failed, _ = tf_lossscale.watch.load_bundle(directory / "bundle")
        weights = failed.get_weights()
        inner = failed.optimizer.inner_optimizer
        twin = _float32_copy(weights, inner)
        expected = late_failures.first_layer_beyond_float16(
            keras, twin, data[0][0])
        reference = twin.fit(x, y, batch_size=model_zoo.IMAGE_BATCH,
                             shuffle=False, verbose=0,
                             initial_epoch=history.epoch[0], epochs=EPOCHS)
        return dict(watch=watch, history=history, reference=reference,
                    record=record, plant=plant, expected=expected)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def test_the_run_fails_after_the_planted_growth_and_once(run):
    reports = run["watch"].reports
    assert run["plant"].planted
    assert len(reports) == 1
    # Noticed within the few skipped steps of the nonfinite-loss trigger.
    assert PLANT_STEP < reports[0].step <= PLANT_STEP + 4, reports[0].step
    before = run["record"].skipped[0][:PLANT_STEP]
    # Healthy until then: the scale's calibration (the first steps skipped
    # in a row, a 2**15 start coming down: 6 here) and a skip now and then
    # (measured: one, at step 12 on TF 2.21, in the fourth epoch on TF
    # 2.16), never two in a row.
    assert before[-1] <= model_zoo.MAX_SKIPPED, before
    calibration = next(i for i, count in enumerate(before) if count != i + 1)
    later = np.diff([0] + before)[calibration:]
    assert later.sum() <= 2 and not (later[1:] & later[:-1]).any(), before


def test_a_diagnosis_of_the_first_batches_called_it_healthy(run):
    baseline = run["watch"].reports[0].baseline
    assert baseline.first_nonfinite_layer is None
    assert baseline.keep_in_float32 == [], baseline.advice()
    assert baseline.loss_scale_range is not None


def test_the_report_names_the_first_convolution(run):
    report = run["watch"].reports[0]
    expected = run["expected"]
    assert expected == "Conv1"  # What the float32 copy says, and where.
    assert report.diagnosis.first_nonfinite_layer == expected
    assert repr(expected) in report.cause
    assert expected in report.diagnosis.keep_in_float32


def test_the_run_carried_on_trains_as_float32_does(run):
    carried, reference = run["history"], run["reference"]
    model = carried.model
    assert model.get_layer("Conv1").compute_dtype == "float32"
    losses = np.array(carried.history["loss"])
    expected = np.array(reference.history["loss"])
    assert carried.epoch == reference.epoch
    assert np.all(np.isfinite(losses))
    # After the fix settles, no step is skipped.
    skipped = run["record"].skipped[-1]
    assert skipped[-1] == skipped[CARRY_ON_SETTLE - 1], skipped
    print(f"failed at step {run['watch'].reports[0].step}; epoch losses "
          f"carried on {losses}, float32 {expected}")
    # Within LOSS_TOLERANCE of the float32 copy's first loss, and learning
    # as it does.
    allowed = LOSS_TOLERANCE * expected[0]
    for epoch in (0, -1):
        assert abs(losses[epoch] - expected[epoch]) <= allowed, (
            losses, expected)
    assert losses[-1] < 0.5 * losses[0], losses

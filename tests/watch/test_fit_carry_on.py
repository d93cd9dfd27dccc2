"""`FailureWatch.fit` with `on_failure="fix"` (docs/guides/failure-watch.md,
"Carrying on" and "Per-layer scaling"): after a failure it fits the fixed
model again from the epoch that failed, from that epoch's first batch; a run
that fails again writes its report to `directory/failure_2`; it fixes at most
`max_fixes` times.

A tiny classifier fails twice on purpose: a callback sets its `logits` bias
beyond float16's range after batch 12 (the float16 forward pass overflows,
every step is skipped, the loss is NaN), and its `hidden` bias after batch
30 (the fixed model, its `logits` in float32, overflows in `hidden`)."""

import functools
import pathlib

import keras
import numpy as np
import pytest

import tf_lossscale
from tests.helpers import late_failures as late

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_fit_carry_on")]

BATCH, EXAMPLES, EPOCHS = 8, 64, 8
BEYOND_FLOAT16 = 1e5


def _data():
    return late.two_layer_data(EXAMPLES)


def _model():
    return late.two_layer_classifier(keras, compiled=True)


class _Plant(keras.callbacks.Callback):
    """Counts batches over every `fit` of the run, records each batch's
    (epoch, batch), and after batch `n` of `plan` (counted from 1) sets the
    named layer's bias to +-BEYOND_FLOAT16."""

    def __init__(self, plan):
        super().__init__()
        self.plan, self.batches, self._epoch = dict(plan), [], None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.batches.append((self._epoch, batch))

    def on_train_batch_end(self, batch, logs=None):
        name = self.plan.get(len(self.batches))
        if name is not None:
            bias = self.model.get_layer(name).bias
            signs = np.resize([1.0, -1.0], bias.shape).astype(np.float32)
            bias.assign(BEYOND_FLOAT16 * signs)


@functools.cache
def _run(max_fixes, directory):
    x, y = _data()
    plant = _Plant({12: "logits", 30: "hidden"})
    watch = tf_lossscale.FailureWatch(
        [(x[:BATCH], y[:BATCH])], steps=1, settle_steps=3,
        on_failure="fix", directory=directory, verbose=False)
    history = watch.fit(_model(), x, y, batch_size=BATCH, epochs=EPOCHS,
                        shuffle=False, verbose=0, callbacks=[plant],
                        max_fixes=max_fixes)
    return watch, history, plant


@pytest.fixture(scope="module")
def once(tmp_path_factory):
    """The run with max_fixes=1: both failures, the first one fixed."""
    return _run(1, str(tmp_path_factory.mktemp("once")))


def test_the_run_carried_on_resumes_at_the_failing_epochs_first_batch(once):
    watch, _, plant = once
    assert [r.diagnosis.first_nonfinite_layer for r in watch.reports] == [
        "logits", "hidden"]
    first = watch.reports[0].step
    # Every batch run counts a step: the failure's batch, then the fixed
    # model's first, that epoch's first batch again.
    failed_epoch, failed_batch = plant.batches[first - 1]
    assert failed_batch > 0
    assert plant.batches[first] == (failed_epoch, 0)


def test_a_second_failure_writes_its_report_to_failure_2(once):
    watch, _, _ = once
    root = pathlib.Path(watch.directory)
    first, second = watch.reports
    assert f"step {first.step}" in (root / "report.txt").read_text()
    assert (root / "failure_2" / "report.txt").read_text() == (
        str(second) + "\n")
    model, _ = tf_lossscale.watch.load_bundle(root / "failure_2" / "bundle")
    assert model.get_layer("logits").compute_dtype == "float32"
    assert not (root / "failure_3").exists()


def test_watch_fit_fixes_at_most_max_fixes_times(once, tmp_path):
    _, history, _ = once
    # The second failure, past max_fixes=1, stopped the run unfixed.
    assert history.model.get_layer("hidden").compute_dtype == "float16"
    assert history.model.get_layer("logits").compute_dtype == "float32"
    assert history.epoch[-1] < EPOCHS - 1
    watch, history, _ = _run(2, str(tmp_path))
    assert len(watch.reports) == 2
    assert history.model.get_layer("hidden").compute_dtype == "float32"
    assert history.epoch[-1] == EPOCHS - 1
    assert np.all(np.isfinite(history.history["loss"]))

"""What docs/guides/failure-watch.md says of a failure's report and its
`fix`, beyond the late-failure runs: `float16_failure_step` in the batch's
logs; the triggers' defaults of the guide's table; `fix` after a failure
before the scale ever settled starts where the scale began, not at the
floor; without a baseline only the diagnosis' layers move, with one the
growing layers too.

A tiny classifier fails on purpose: a callback sets its `logits` bias beyond
float16's range (and its `hidden` bias high within it) after a given batch;
the float16 forward pass overflows and every later step is skipped."""

import inspect

import keras
import numpy as np
import pytest

import tf_lossscale
from tests.helpers import late_failures as late
from tf_lossscale.watch import triggers as triggers_lib

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_report_claims")]

BATCH, EXAMPLES = 8, 64


def _data():
    return late.two_layer_data(EXAMPLES)


def _model():
    return late.two_layer_classifier(keras, compiled=True)


class _Plant(keras.callbacks.Callback):
    """After batch `at` (counted from 1): `logits` bias +-1e5 (beyond
    float16), and `hidden` bias `hidden` (None: left as it is)."""

    def __init__(self, at, hidden=None):
        super().__init__()
        self.at, self.hidden, self.count = at, hidden, 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1
        if self.count == self.at:
            self.model.get_layer("logits").bias.assign([1e5, -1e5])
            if self.hidden is not None:
                bias = self.model.get_layer("hidden").bias
                bias.assign(np.full(bias.shape, self.hidden, np.float32))


class _BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs or {}))


def _failed_fit(at, callbacks=(), hidden=None, **watch_args):
    x, y = _data()
    model = _model()
    watch = tf_lossscale.FailureWatch([(x[:BATCH], y[:BATCH])], steps=1,
                                      on_failure="stop", verbose=False,
                                      **watch_args)
    history = model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False,
                        verbose=0, callbacks=[_Plant(at, hidden), watch,
                                              *callbacks])
    assert watch.report is not None, "the planted overflow failed no step"
    return model, watch.report, history


def test_the_triggers_defaults_are_the_guides_table():
    watch = tf_lossscale.FailureWatch([])
    triggers = watch.triggers
    assert (triggers.max_consecutive_skips, triggers.nonfinite_loss_steps,
            triggers.at_floor, triggers.scale_drop_binades,
            triggers.settle_steps) == (20, 3, True, 10, 50)
    assert (watch.on_failure, watch.fix_horizon) == ("raise", 0.25)
    assert inspect.signature(watch.fit).parameters["max_fixes"].default == 3
    assert triggers_lib.Triggers().settle_steps == 50


def test_the_failure_step_is_in_the_batch_logs_of_callbacks_after_it():
    after = _BatchLogs()
    _, report, history = _failed_fit(12, [after], settle_steps=3)
    steps = [logs.get("float16_failure_step") for logs in after.logs]
    assert steps == [None] * (report.step - 1) + [report.step]
    # `fit` stopped at the failure (model.stop_training).
    assert len(after.logs) == report.step
    assert history.epoch[-1] == (report.step - 1) // (EXAMPLES // BATCH)


def test_fix_before_the_scale_settled_starts_where_the_scale_began():
    # The default settle_steps=50: a failure at step 5 finds it unsettled.
    model, report, _ = _failed_fit(2)
    began = model.optimizer.loss_scale.initial_loss_scale
    assert report.settled_scale is None
    assert report.scale < began  # Backed off by the skipped steps.
    fixed = report.fix(model)
    assert float(fixed.optimizer.loss_scale()) == began
    assert fixed.optimizer.loss_scale.get_config() == (
        model.optimizer.loss_scale.get_config())


def test_without_a_baseline_only_the_diagnosed_layers_move():
    # `hidden` grows 2**13 from where it began, well within float16: with a
    # baseline it would overflow within fix_horizon times as many steps
    # again, and moves too; without one only `logits` does.
    model, report, _ = _failed_fit(12, hidden=2e4, settle_steps=3,
                                   baseline=True)
    assert report.diagnosis.keep_in_float32 == ["logits"]
    assert "hidden" in report.growing_layers()
    fixed = report.fix(model)
    assert [fixed.get_layer(name).compute_dtype
            for name in ("hidden", "logits")] == ["float32", "float32"]
    unbased = tf_lossscale.FailureReport(
        step=report.step, reason=report.reason, scale=report.scale,
        settled_scale=report.settled_scale,
        skipped_steps=report.skipped_steps, diagnosis=report.diagnosis,
        baseline=None, batches=report.batches, fix_horizon=100.0)
    assert unbased.growth() == {} and unbased.growing_layers() == []
    fixed = unbased.fix(model)
    assert [fixed.get_layer(name).compute_dtype
            for name in ("hidden", "logits")] == ["float16", "float32"]

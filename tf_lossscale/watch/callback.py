"""`FailureWatch`: the Keras callback, and the call for custom loops, that
notices a persistent float16 failure, diagnoses the model as it is then, and
stops, or carries the run on with the fixed model (`FailureWatch.fit`).

Per batch end it reads the scale and the skipped steps, nothing more; the
diagnosis runs once, at the failure (docs/guides/failure-watch.md).
"""

import itertools
import os

import keras
import numpy as np
import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale.diagnosis import measure
from tf_lossscale.diagnosis import models
from tf_lossscale.monitor import xla_callback
from tf_lossscale.watch import failure
from tf_lossscale.watch import triggers as triggers_lib

ON_FAILURE = ("raise", "stop", "fix")


def _numpy(batch):
    return tuple(None if part is None else tf.nest.map_structure(
        np.asarray, part) for part in tuple(batch) + (None,) * (3 - len(batch)))


class _Watch:
    """`FailureWatch` on either Keras' Callback (the next class in the MRO)."""

    def __init__(self, data, *, on_failure="raise", steps=4, baseline=None,
                 directory=None, log_dir=None, max_consecutive_skips=20,
                 nonfinite_loss_steps=3, scale_drop_binades=10,
                 settle_steps=50, at_floor=True, fix_horizon=0.25,
                 verbose=True):
        super().__init__()
        if data is None:
            raise ValueError("data must hold the batches to diagnose at a "
                             "failure (the training data), got None")
        self.data = data
        self.on_failure = checks.one_of("on_failure", on_failure, ON_FAILURE)
        self.steps = checks.positive_int("steps", steps)
        if baseline is not None and baseline is not True and not hasattr(
                baseline, "keep_in_float32"):
            raise TypeError("baseline must be None, True or a "
                            "Float16Diagnosis, got "
                            f"{checks.summary(baseline)}")
        self.baseline = baseline
        for name, value in (("directory", directory), ("log_dir", log_dir)):
            checks.of_type(name, value, (str, os.PathLike, type(None)),
                           "a path or None")
        self.directory, self.log_dir = directory, log_dir
        self.fix_horizon = checks.finite_float32("fix_horizon", fix_horizon,
                                                 at_least=0)
        self.verbose = checks.boolean("verbose", verbose)
        self.triggers = triggers_lib.Triggers(
            max_consecutive_skips, nonfinite_loss_steps, scale_drop_binades,
            settle_steps, at_floor)
        self.report = None
        self.reports = []
        self._watched = None
        self._tensorboard_dir = None  # A TensorBoard callback's, in `fit`.
        self._epoch = 0  # The epoch going on, to carry a run on from.
        self._workers, self._writes = False, True

    # The call for custom loops.

    def start(self, model):
        """Starts watching `model` (compiled with a
        `tf_lossscale.LossScaleOptimizer`) from its present state; diagnoses
        the baseline if asked."""
        # Refused now, not at the failure: a model the diagnosis cannot run.
        models.check_model(model, "FailureWatch")
        self._watched = model
        self.triggers.start(xla_callback.check_optimizer(
            getattr(model, "optimizer", None), who="FailureWatch"))
        # Every worker must decide alike, as the diagnosis runs collectives:
        # from the agreed loss-scale state only, not its own loss. One, the
        # chief, writes the files.
        strategy = model.distribute_strategy
        self._workers = isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy)
        self._writes = getattr(strategy.extended, "should_checkpoint", True)
        self._baseline_step = self.triggers.step
        if self.baseline is True:
            self.baseline = measure.diagnose(model, self.data, self.steps,
                                             verbose=0)

    def after_step(self, model, loss=None, steps=1):
        """In a custom loop, after each step (or `steps` steps) of `model`:
        returns None, or the `FailureReport` of a failure (with "raise",
        raises its `Float16FailureError`). The first call for a model, unless
        `start` was called before its first step, starts the watch.
        `loss`: the step's loss (a number or scalar tensor), or None."""
        if self._watched is not model:
            # The state read now already holds this step: watched from here.
            self.start(model)
            return None
        loss = None if loss is None or self._workers else float(loss)
        why = self.triggers.after(steps, loss)
        return None if why is None else self._fail(why)

    def _fail(self, why):
        model = self._watched
        batches = [_numpy(batch)
                   for batch in itertools.islice(iter(self.data), self.steps)]
        diagnosis = measure.diagnose(model, batches, len(batches) or 1,
                                     verbose=0)
        self.report = failure.FailureReport(
            step=self.triggers.step, reason=why, scale=self.triggers.scale,
            settled_scale=self.triggers.settled_scale,
            skipped_steps=int(np.asarray(model.optimizer.skipped_steps)),
            diagnosis=diagnosis,
            baseline=None if self.baseline is True else self.baseline,
            batches=batches, baseline_step=self._baseline_step,
            fix_horizon=self.fix_horizon)
        self.reports.append(self.report)
        if self.directory is not None and self._writes:
            # A run carried on that fails again writes beside the first.
            self.report.save(os.path.join(self.directory, *(
                [f"failure_{len(self.reports)}"] if len(self.reports) > 1
                else [])), model)
        log_dir = self.log_dir or self._tensorboard_dir
        if log_dir is not None and self._writes:
            with tf.summary.create_file_writer(str(log_dir)).as_default():
                tf.summary.text("float16_failure", str(self.report),
                                step=self.triggers.step)
        if self.on_failure == "raise":
            raise failure.Float16FailureError(self.report)
        if self.verbose:
            print(f"\nFailureWatch: {self.report}")
        return self.report

    # The Keras callback.

    def on_train_begin(self, logs=None):
        if self._watched is not self.model:
            self.start(self.model)
        else:  # A model carried on: its new optimizer, the same baseline.
            self.triggers.start(self.model.optimizer)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = None if logs is None else logs.get("loss")
        steps = int(getattr(self.model, "steps_per_execution", 1) or 1)
        report = self.after_step(self.model, loss, steps)
        if report is not None:
            if logs is not None:
                logs["float16_failure_step"] = report.step
            self.model.stop_training = True

    def fit(self, model, *args, max_fixes=3, **kwargs):
        """`model.fit(*args, **kwargs)` watched; with `on_failure="fix"`, at
        a failure it carries the run on: `report.fix(model)` (the fixed
        model with the optimizer state and the settled loss scale), then
        `fit` again from the failing epoch (its batches from the first),
        at most `max_fixes` times. Returns the last `History`; its `model`
        is the model that finished training. Without `log_dir`, the report
        goes to a `keras.callbacks.TensorBoard`'s among `callbacks`."""
        max_fixes = checks.positive_int("max_fixes", max_fixes)
        callbacks = list(kwargs.pop("callbacks", None) or [])
        # Keras 3's or tf-keras' TensorBoard callback.
        self._tensorboard_dir = next(
            (callback.log_dir for callback in callbacks
             if type(callback).__name__ == "TensorBoard"), None)
        for fixes in itertools.count():
            failed_at = len(self.reports)
            self._epoch = kwargs.get("initial_epoch", 0)
            history = model.fit(*args, callbacks=[*callbacks, self],
                                **kwargs)
            if (self.on_failure != "fix" or len(self.reports) == failed_at
                    or fixes == max_fixes):
                return history
            model = self.report.fix(model)
            self._watched = model
            kwargs["initial_epoch"] = self._epoch


class FailureWatch(_Watch, xla_callback.EitherKeras,
                   keras.callbacks.Callback):
    """Watches a float16 run and diagnoses it where it fails.

    After each batch (or, in a custom loop, each `after_step`) it reads the
    loss scale and the skipped steps, and calls the run failed on any of the
    triggers below. It then diagnoses the model as it is
    (`tf_lossscale.diagnose` on the first `steps` batches of `data`), builds
    a `FailureReport`, puts `float16_failure_step` in the batch's logs,
    saves the report to `directory` and a text summary to `log_dir` if
    given, and acts as `on_failure` says.

    Args:
      data: the batches to diagnose at the failure, as `diagnose` takes them
        (the training data: a `tf.data.Dataset` or a list of `(x, y)`).
      on_failure: "raise" (the default: a `Float16FailureError` whose
        message is the report), "stop" (print it and stop training) or
        "fix" (stop; `FailureWatch.fit` then carries the run on).
      steps: how many batches of `data` to diagnose.
      baseline: None, True (diagnose when training begins, to report how
        the layers' outputs grew), or a `Float16Diagnosis` made before.
      directory: where to save the report and the reproduction bundle.
      log_dir: a TensorBoard log directory for the report as text (in
        `FailureWatch.fit`, by default that of a TensorBoard callback).
      max_consecutive_skips: fail after this many steps skipped in a row,
        once the scale has settled.
      nonfinite_loss_steps: fail when the loss is not finite and this many
        steps in a row were skipped.
      scale_drop_binades: fail when the scale falls this many powers of 2
        below where it had settled.
      settle_steps: the scale has settled where it held this many steps.
      at_floor: fail on a skip with the scale at its floor. (Each of the
        triggers: `tf_lossscale.watch.Triggers`; None turns one off.)
      fix_horizon: a fix also keeps in float32 the float16 layers that,
        growing as they grew since the baseline, would overflow within this
        many times as many steps again (`FailureReport.growing_layers`); 0:
        only the diagnosis' layers.
      verbose: print the report when it does not raise.

    With `TF_USE_LEGACY_KERAS=1` the object made is a tf-keras callback
    (`for_tf_keras`).
    """

"""`LossScaleMonitor`: the Keras callback that puts the loss scale and the
skipped steps in Keras' logs, and prints skipped steps by burst.

What it logs, what it costs and how it prints: docs/guides/monitoring.md.
"""

import keras

from tf_lossscale._internal import checks
from tf_lossscale._internal import versions
from tf_lossscale.monitor import gradient_stats
from tf_lossscale.monitor import xla_callback
from tf_lossscale.ops import float16

# Skips at most this many steps apart belong to one burst (a line for its
# first skip, one summary line for the rest); read when training begins.
BURST_GAP_STEPS = 10
# A burst still going on is summarized after this many unreported skips.
BURST_SUMMARY_SKIPS = 100
# Variables named in a line; a large model can have hundreds overflow at once.
_MAX_NAMED_VARIABLES = 5
# Keras 3 before 3.11 passes a batch end the first step of its execution of
# `steps_per_execution` steps; later Keras 3 and tf-keras pass its last.
_BATCH_END_NAMES_FIRST_STEP = versions.release_series(keras.__version__) < (
    3, 11)


def _steps(first, last):
    return f"step {last}" if first == last else f"steps {first}-{last}"


class _SkipPrinter:
    """Prints one `fit`'s skipped steps: a line for the first skip of a burst
    (naming the variables that overflowed: one small read), one for the rest
    when the burst ends or reaches `summary_skips` skips."""

    def __init__(self, optimizer, gap_steps, summary_skips):
        self._optimizer = optimizer
        self._gap_steps = gap_steps
        self._summary_skips = summary_skips
        self._last = None  # The burst's last skipped step; None: no burst.
        self._scale = None  # The scale after it.
        self._pending = None  # (count, first step, scale before) unprinted.

    def report(self, new_skips, first_step, last_step, scale_before,
               scale_after):
        """Takes a batch end: `new_skips` of the steps `first_step` to
        `last_step` were skipped; the scale went from `scale_before`."""
        if self._last is not None and (
                first_step - self._last > self._gap_steps + 1):
            self.end()
        if not new_skips:
            return
        if self._last is None:
            self._print_first(new_skips, first_step, last_step, scale_before,
                              scale_after)
        else:
            count, first, before = self._pending or (0, first_step,
                                                     scale_before)
            self._pending = (count + new_skips, first, before)
        self._last, self._scale = last_step, scale_after
        if self._pending and self._pending[0] >= self._summary_skips:
            self._print_pending()

    def _print_first(self, new_skips, first_step, last_step, scale_before,
                     scale_after):
        if first_step == last_step:
            what = f"skipped step {last_step}"
        else:
            what = f"skipped {new_skips} of {_steps(first_step, last_step)}"
        paths = self._optimizer.last_nonfinite_variables()
        named = ", ".join(paths[:_MAX_NAMED_VARIABLES])
        if len(paths) > _MAX_NAMED_VARIABLES:
            named += f" and {len(paths) - _MAX_NAMED_VARIABLES} more"
        print(f"\nLossScaleMonitor: {what}; loss scale {scale_before!r} -> "
              f"{scale_after!r}; non-finite gradients: "
              f"{named or 'none recorded'}")

    def _print_pending(self):
        count, first, before = self._pending
        self._pending = None
        plural = "s" if count > 1 else ""
        print(f"\nLossScaleMonitor: {count} more skipped step{plural} in "
              f"{_steps(first, self._last)}; loss scale {before!r} -> "
              f"{self._scale!r}")

    def end(self):
        """Prints what the burst has not printed yet, and ends it."""
        if self._pending:
            self._print_pending()
        self._last = None


class _Monitor(xla_callback.FitWatcher):
    """`LossScaleMonitor` on either Keras' Callback (the next class in the
    MRO): `XlaChecks` whose read of the scale after each batch acts."""

    def __init__(self, verbose=False, gradient_stats=False):
        verbose = checks.boolean("verbose", verbose)
        gradient_stats = checks.boolean("gradient_stats", gradient_stats)
        super().__init__()
        self.verbose = verbose
        self.gradient_stats = gradient_stats
        self._stats = None

    def _read(self):
        # One device read each, and nothing else: this runs after every batch.
        # Reading the scale first acts on what XLA steps left to the host.
        with self._ending_on_error():
            return (float(self._optimizer.loss_scale()),
                    int(self._optimizer.skipped_steps))

    def _log(self, logs):
        scale, skipped = self._read()
        if logs is not None:
            logs["loss_scale"], logs["skipped_steps"] = scale, skipped
            if self._stats is not None:
                (logs["grad_underflow_share"],
                 logs["grad_headroom_log2"]) = self._stats.read()
        return scale, skipped

    def on_train_begin(self, logs=None):
        self._optimizer = self._begin(act=False)
        self._scale, self._skipped = self._read()
        self._step = self._epoch_first_step = 0
        self._printer = _SkipPrinter(self._optimizer, BURST_GAP_STEPS,
                                     BURST_SUMMARY_SKIPS)
        if self.gradient_stats:
            self._stats = gradient_stats.attach(
                self._optimizer, float16.float16_variables(self.model),
                self.model.distribute_strategy)
            # A train function traced before now holds no statistics.
            self.model.make_train_function(force=True)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_first_step = self._step

    def on_train_batch_end(self, batch, logs=None):
        scale, skipped = self._log(logs)
        # A batch end covers the steps of one execution.
        first_step = self._step + 1
        self._step = self._epoch_first_step + self._last_step(batch) + 1
        if self.verbose:
            self._printer.report(skipped - self._skipped, first_step,
                                 self._step, self._scale, scale)
        self._scale, self._skipped = scale, skipped

    def _last_step(self, batch):
        # The last step (from 0 in the epoch) of the batch end's execution,
        # which may be shorter than steps_per_execution at the epoch's end.
        if _BATCH_END_NAMES_FIRST_STEP and isinstance(
                self, keras.callbacks.Callback):
            batch += int(getattr(self.model, "steps_per_execution", 1)
                         or 1) - 1
        steps = (self.params or {}).get("steps")
        return min(batch, steps - 1) if steps else batch

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            self._log(logs)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        if self._stats is not None:
            self._stats = None
            gradient_stats.detach(self._optimizer)
            # So that later steps record nothing.
            self.model.make_train_function(force=True)
        self._printer.end()


class LossScaleMonitor(_Monitor, xla_callback.EitherKeras,
                       keras.callbacks.Callback):
    """Adds `loss_scale` and `skipped_steps` to every batch's and epoch's logs.

    List it before the callbacks that should see the two values (the progress
    bar and `History` always come after it). It costs two small reads from the
    device per batch end, and does what `XlaChecks` does.

    Args:
      verbose: if True, print skipped steps, rate-limited (one line for the
        first skip of a burst, one summary line for the rest of it). Steps are
        counted from 1 at the start of each `fit` call.
      gradient_stats: if True, also add `grad_underflow_share` and
        `grad_headroom_log2`, measured in the train step (which costs that
        step some work, and a retrace of it when training begins and ends).

    Raises:
      TypeError: `verbose` or `gradient_stats` is not a bool; at the start
        of training, the model's optimizer is not a
        `tf_lossscale.LossScaleOptimizer`.

    With `TF_USE_LEGACY_KERAS=1` the object made is a tf-keras callback
    (`for_tf_keras`).
    """

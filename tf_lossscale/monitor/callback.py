"""`LossScaleMonitor`: the Keras callback that logs the loss scale and the
skipped steps (docs/guides/monitoring.md)."""

import keras

from tf_lossscale._internal import checks
from tf_lossscale._internal import versions
from tf_lossscale import groups as group_lib
from tf_lossscale.monitor import gradient_stats
from tf_lossscale.monitor import xla_callback
from tf_lossscale.ops import float16

# Skips at most this many steps apart belong to one burst.
BURST_GAP_STEPS = 10
# A burst still going on is summarized after this many unreported skips.
BURST_SUMMARY_SKIPS = 100
# Variables named in a line.
_MAX_NAMED_VARIABLES = 5
# Keras 3 before 3.11 passes a batch end the first step of its execution;
# later Keras 3 and tf-keras pass its last.
_BATCH_END_NAMES_FIRST_STEP = versions.release_series(keras.__version__) < (
    3, 11)


def _steps(first, last):
    return f"step {last}" if first == last else f"steps {first}-{last}"


class _SkipPrinter:
    """Prints one `fit`'s skipped steps: a line for the first skip of a burst,
    one for the rest when it ends or has `BURST_SUMMARY_SKIPS` of them."""

    def __init__(self, optimizer, label=None):
        self._optimizer = optimizer
        self._who = "" if label is None else f" {label}:"
        self._last = None  # The burst's last skipped step; None: no burst.
        self._rest = None  # Unprinted [skips, first step, before, after].

    def report(self, skips, first_step, last_step, before, after):
        """Takes a batch end: `skips` of the steps `first_step` to
        `last_step` were skipped; the scale went from `before` to `after`."""
        if self._last is not None and (
                first_step - self._last > BURST_GAP_STEPS):
            self.end()
        if not skips:
            return
        if self._last is None:
            self._print_first(skips, first_step, last_step, before, after)
        elif self._rest:
            self._rest[0] += skips
            self._rest[3] = after
        else:
            self._rest = [skips, first_step, before, after]
        self._last = last_step
        if self._rest and self._rest[0] >= BURST_SUMMARY_SKIPS:
            self._print_rest()

    def _print_first(self, skips, first_step, last_step, before, after):
        what = (f"skipped step {last_step}" if first_step == last_step else
                f"skipped {skips} of {_steps(first_step, last_step)}")
        paths = self._optimizer.last_nonfinite_variables()
        named = ", ".join(paths[:_MAX_NAMED_VARIABLES])
        if len(paths) > _MAX_NAMED_VARIABLES:
            named += f" and {len(paths) - _MAX_NAMED_VARIABLES} more"
        print(f"\nLossScaleMonitor:{self._who} {what}; loss scale "
              f"{before!r} -> {after!r}; non-finite gradients: "
              f"{named or 'none recorded'}")

    def _print_rest(self):
        skips, first, before, after = self._rest
        self._rest = None
        print(f"\nLossScaleMonitor:{self._who} {skips} more skipped step"
              f"{'s' if skips > 1 else ''} in {_steps(first, self._last)}; "
              f"loss scale {before!r} -> {after!r}")

    def end(self):
        """Prints what the burst has not printed yet, and ends it."""
        if self._rest:
            self._print_rest()
        self._last = None


class _Monitor(xla_callback.FitWatcher):
    """`LossScaleMonitor` on either Keras' Callback (next in the MRO)."""

    def __init__(self, verbose=False, gradient_stats=False, *,
                 optimizers=None):
        super().__init__(optimizers)
        self.verbose = checks.boolean("verbose", verbose)
        self.gradient_stats = checks.boolean("gradient_stats", gradient_stats)
        if gradient_stats and self._given is not None and len(
                self._given) > 1:
            raise ValueError("gradient_stats=True watches one optimizer's "
                             "steps; optimizers names "
                             f"{len(self._given)}")
        self._stats = None

    def _read(self):
        """`({label: scale}, {label: skipped steps})`, one device read each
        (a shared scale once); reading the scale acts on XLA's records."""
        scales, skipped = {}, {}
        with self._ending_on_error():
            read = {}
            for label, optimizer in self._watched.items():
                shared = self._shared[label]
                if id(shared) not in read:
                    read[id(shared)] = float(optimizer.loss_scale())
                scales[label] = read[id(shared)]
                skipped[label] = int(optimizer.skipped_steps)
        return scales, skipped

    def _keys(self, label, name):
        return name if label is None else f"{label}_{name}"

    def _log(self, logs):
        scales, skipped = self._read()
        if logs is not None:
            if len(set(map(id, self._shared.values()))) == 1:
                logs["loss_scale"] = next(iter(scales.values()))
            else:
                for label, scale in scales.items():
                    logs[self._keys(label, "loss_scale")] = scale
            for label, count in skipped.items():
                logs[self._keys(label, "skipped_steps")] = count
            if self._stats is not None:
                (logs["grad_underflow_share"],
                 logs["grad_headroom_log2"]) = self._stats.read()
            # A model scaled per layer: each segment's factor.
            for optimizer in self._watched.values():
                scaling = getattr(optimizer, "_gradient_scaling", None)
                if scaling is not None:
                    logs.update({f"gradient_factor/{name}": value
                                 for name, value
                                 in scaling.factor_values().items()})
        return scales, skipped

    def on_train_begin(self, logs=None):
        self._watched = self._begin(act=False)
        self._shared = {label: group_lib.underlying(optimizer.loss_scale)
                        for label, optimizer in self._watched.items()}
        self._scale, self._skipped = self._read()
        self._step = self._epoch_first_step = 0
        self._printers = {label: _SkipPrinter(optimizer, label)
                          for label, optimizer in self._watched.items()}
        self._optimizer = next(iter(self._watched.values()))
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
            for label, printer in self._printers.items():
                printer.report(skipped[label] - self._skipped[label],
                               first_step, self._step, self._scale[label],
                               scale[label])
        self._scale, self._skipped = scale, skipped

    def _last_step(self, batch):
        # The last step (from 0 in the epoch) of the batch end's execution.
        if _BATCH_END_NAMES_FIRST_STEP and isinstance(
                self, keras.callbacks.Callback):
            batch += int(self.model.steps_per_execution) - 1
        steps = self.params.get("steps")
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
        for printer in self._printers.values():
            printer.end()


class LossScaleMonitor(_Monitor, xla_callback.EitherKeras,
                       keras.callbacks.Callback):
    """Adds `loss_scale` and `skipped_steps` to every batch's and epoch's logs
    (and, for a model scaled per layer, each segment's factor as
    `gradient_factor/<its first layer>`: `tf_lossscale.layerwise`).

    List it before the callbacks that should see them (the progress bar and
    `History` come after it). It does what `XlaChecks` does.

    With `optimizers` (a custom `train_step` stepping several optimizers,
    a GAN's), the logs hold `loss_scale` once when they share one loss scale
    (a `LossScaleGroup`), else `<label>_loss_scale` for each, and
    `<label>_skipped_steps` for each optimizer.

    Args:
      verbose: if True, print skipped steps, rate-limited (one line for the
        first skip of a burst, one summary line for the rest of it). Steps are
        counted from 1 at the start of each `fit` call.
      gradient_stats: if True, also add `grad_underflow_share` and
        `grad_headroom_log2`, measured in the train step (which costs that
        step some work, and a retrace of it when training begins and ends);
        for one optimizer only.
      optimizers: keyword-only; None (the default: the model's optimizer),
        or the `tf_lossscale.LossScaleOptimizer`s to watch, as a dict of
        labels to optimizers (`{"d": d_optimizer, "g": g_optimizer}`) or a
        list (labelled by their names).

    Raises:
      TypeError: `verbose` or `gradient_stats` is not a bool, `optimizers`
        is none of the above or holds another optimizer; at the start of
        training, with `optimizers=None`, the model's optimizer is not a
        `tf_lossscale.LossScaleOptimizer`.
      ValueError: `optimizers` is empty or gives two optimizers one label,
        or `gradient_stats=True` with several optimizers.

    With `TF_USE_LEGACY_KERAS=1` the object made is a tf-keras callback
    (`for_tf_keras`).
    """

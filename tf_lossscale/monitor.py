"""`LossScaleMonitor`: the loss scale and the skipped steps in Keras' logs.

    model.fit(x, y, callbacks=[tf_lossscale.LossScaleMonitor(),
                               keras.callbacks.CSVLogger("log.csv")])

Keras hands one `logs` dict through the callbacks in list order. At the end
of every batch (every `steps_per_execution` steps) and of every epoch the
monitor adds two entries to it:

* `loss_scale`: the current loss scale, a Python float;
* `skipped_steps`: the optimizer's cumulative count of skipped steps, an int
  (it travels in `.keras` files and checkpoints, so it continues after a
  reload).

Everything after the monitor sees them: the progress bar, `History.history`,
`CSVLogger` columns, `keras.callbacks.TensorBoard` scalars (`batch_loss_scale`,
`epoch_loss_scale`, ...). Callbacks listed before it do not.

Cost: three small reads from the device per batch end, nothing in the train
step itself. It also carries out what an XLA-compiled step leaves to the
host (`XlaChecks`), so with it no `XlaChecks` is needed. Under a
`tf.distribute` strategy every replica holds the same
values (all replicas take the same skip decision), so the first replica's are
read.

With `verbose=True` skipped steps are also printed, rate-limited: the first
skip of a burst gets one line with the step, the scale before and after and
the variables whose gradients were not finite
(`LossScaleOptimizer.last_nonfinite_variables()`); the rest of the burst is
summarized in one line when it ends. A burst is a run of skips with at most
`BURST_GAP_STEPS` finite steps between them, so a calibration from a too
large initial scale, or a run that skips every other step, prints two lines,
not one per step. A burst that goes on is summarized every
`BURST_SUMMARY_SKIPS` skipped steps, and whatever is pending when training
ends is printed then.

tf-keras (Keras 2) models need a tf-keras callback: with
`TF_USE_LEGACY_KERAS=1` (when `tf.keras` is tf-keras) `LossScaleMonitor()`
is one; with `tf_keras` imported directly, use
`LossScaleMonitor.for_tf_keras()`. That class is created on first use, so
Keras 3 users never import tf_keras.
"""

import functools

import keras

from tf_lossscale import keras_compat
from tf_lossscale import optimizer_protocol
from tf_lossscale import xla_checks

# Skips at most this many steps apart belong to one burst.
BURST_GAP_STEPS = 10
# A burst still going on is summarized after this many unreported skips.
BURST_SUMMARY_SKIPS = 100
# Variables named in a line; a large model can have hundreds overflow at once.
_MAX_NAMED_VARIABLES = 5


def _check_optimizer(optimizer):
    if isinstance(optimizer, optimizer_protocol.ScaledLossProtocol):
        return
    kind = type(optimizer)
    hint = ""
    if hasattr(optimizer, "inner_optimizer"):  # Keras 3 or tf-keras own.
        inner = type(optimizer.inner_optimizer).__name__
        hint = (f" (wrapping {inner}); under the mixed_float16 policy Keras "
                "wraps any other optimizer in its own LossScaleOptimizer, so "
                "pass optimizer=tf_lossscale.LossScaleOptimizer(...) to "
                "compile")
    raise TypeError(
        "LossScaleMonitor needs a model compiled with a "
        "tf_lossscale.LossScaleOptimizer, but model.optimizer is "
        f"{optimizer!r} of type {kind.__module__}.{kind.__qualname__}{hint}")


def _steps(first, last):
    return f"step {last}" if first == last else f"steps {first}-{last}"


def _variable_list(paths):
    named = ", ".join(paths[:_MAX_NAMED_VARIABLES])
    if len(paths) > _MAX_NAMED_VARIABLES:
        named += f" and {len(paths) - _MAX_NAMED_VARIABLES} more"
    return named or "none recorded"


class _Burst:
    """Skips since the last printed line of the current burst."""

    def __init__(self, last_step, scale):
        self.last_step = last_step
        self.count = 0
        self.first_step = None
        self.scale_before = scale
        self.scale_after = scale

    def add(self, count, first_step, last_step, scale_before, scale_after):
        if not self.count:
            self.first_step = first_step
            self.scale_before = scale_before
        self.count += count
        self.last_step = last_step
        self.scale_after = scale_after

    def summary(self):
        plural = "s" if self.count > 1 else ""
        return (f"LossScaleMonitor: {self.count} more skipped step{plural} in "
                f"{_steps(self.first_step, self.last_step)}; loss scale "
                f"{self.scale_before!r} -> {self.scale_after!r}")


def _reengaged(checks, optimizer):
    """New `HostChecks` for `optimizer`, after closing `checks`: a fit that
    failed outside the callbacks never called on_train_end."""
    if checks is not None:
        checks.close()
    return xla_checks.HostChecks(optimizer)


class XlaChecks(keras.callbacks.Callback):
    """Carries out, after each batch, what an XLA-compiled step cannot.

    Under XLA (`jit_compile`, Keras' default when a GPU is visible) a step can
    neither fail nor print, so `DynamicLossScale`'s state check,
    `on_min_loss_scale="raise"`/`"warn"` and `max_consecutive_skips` are
    carried out on the host after each executed call (`steps_per_execution`
    steps), with the same errors and warnings. `fit` and `train_on_batch`
    engage those checks by themselves; this callback (or a
    `LossScaleMonitor`, which does the same) engages them explicitly, for a
    trainer that calls its step otherwise. Without XLA it costs one scalar
    read per batch and does nothing else.

    Raises:
      TypeError: at the start of training, the model's optimizer is not a
        `tf_lossscale.LossScaleOptimizer`.
    """

    def __init__(self):
        super().__init__()
        self._checks = None

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        _check_optimizer(optimizer)
        self._checks = _reengaged(self._checks, optimizer)

    def on_train_batch_end(self, batch, logs=None):
        self._checks.check()

    def on_train_end(self, logs=None):
        self._checks.close()


class _Monitor:
    """The monitor, for either framework's Callback base (the next class in
    the MRO); see `LossScaleMonitor`."""

    def __init__(self, verbose=False):
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be a bool, got {verbose!r}")
        super().__init__()
        self.verbose = verbose
        self._optimizer = None
        self._scale = None
        self._skipped = None
        self._step = 0
        self._epoch_first_step = 0
        self._burst = None
        self._checks = None

    def _read(self):
        # One device read each, and nothing else: this runs after every batch.
        return (float(self._optimizer.loss_scale()),
                int(self._optimizer.skipped_steps))

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        _check_optimizer(optimizer)
        self._optimizer = optimizer
        self._checks = _reengaged(self._checks, optimizer)
        self._scale, self._skipped = self._read()
        self._step = 0
        self._epoch_first_step = 0
        self._burst = None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_first_step = self._step

    def on_train_batch_end(self, batch, logs=None):
        # Under XLA the step's failures and warnings come first, as they
        # would without XLA (see XlaChecks).
        self._checks.check()
        scale, skipped = self._read()
        if logs is not None:
            logs["loss_scale"] = scale
            logs["skipped_steps"] = skipped
        # With steps_per_execution > 1, a batch end covers the execution's
        # steps, which are not seen one by one.
        first_step = self._step + 1
        self._step = (self._epoch_first_step
                      + keras_compat.last_step_of_batch(self, batch) + 1)
        if self.verbose:
            self._report(skipped - self._skipped, first_step, scale)
        self._scale, self._skipped = scale, skipped

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["loss_scale"], logs["skipped_steps"] = self._read()

    def on_train_end(self, logs=None):
        self._checks.close()
        self._end_burst()

    # Verbose mode.

    def _report(self, new_skips, first_step, scale):
        burst = self._burst
        if burst is not None and (
                first_step - burst.last_step > BURST_GAP_STEPS + 1):
            self._end_burst()
            burst = None
        if not new_skips:
            return
        if burst is None:
            self._print_skip(new_skips, first_step, scale)
            self._burst = _Burst(self._step, scale)
            return
        burst.add(new_skips, first_step, self._step, self._scale, scale)
        if burst.count >= BURST_SUMMARY_SKIPS:
            print("\n" + burst.summary())
            self._burst = _Burst(self._step, scale)

    def _print_skip(self, new_skips, first_step, scale):
        if first_step == self._step:
            what = f"skipped step {self._step}"
        else:
            what = f"skipped {new_skips} of {_steps(first_step, self._step)}"
        variables = self._optimizer.last_nonfinite_variables()
        print(f"\nLossScaleMonitor: {what}; loss scale {self._scale!r} -> "
              f"{scale!r}; non-finite gradients: {_variable_list(variables)}")

    def _end_burst(self):
        if self._burst is not None and self._burst.count:
            print("\n" + self._burst.summary())
        self._burst = None


class LossScaleMonitor(_Monitor, keras.callbacks.Callback):
    """Adds `loss_scale` and `skipped_steps` to every batch's and epoch's logs.

    List it before the callbacks that should see the two values (the progress
    bar and `History` always come after it). See the module docstring.

    Args:
      verbose: if True, print skipped steps, rate-limited (one line for the
        first skip of a burst, one summary line for the rest of it). Steps are
        counted from 1 at the start of each `fit` call.

    Raises:
      TypeError: `verbose` is not a bool; at the start of training, the
        model's optimizer is not a `tf_lossscale.LossScaleOptimizer`.

    With `TF_USE_LEGACY_KERAS=1` the object made is a tf-keras callback
    (`for_tf_keras`).
    """

    def __new__(cls, *args, **kwargs):
        if cls is LossScaleMonitor and optimizer_protocol.tf_keras_is_tf_keras():
            return cls.for_tf_keras(*args, **kwargs)
        return super().__new__(cls)

    @staticmethod
    def for_tf_keras(verbose=False):
        """The monitor as a `tf_keras.callbacks.Callback`, for tf-keras'
        `fit`."""
        return _tf_keras_monitor_class()(verbose)


@functools.lru_cache(maxsize=None)
def _tf_keras_monitor_class():
    import tf_keras  # pylint: disable=g-import-not-at-top

    class TfKerasLossScaleMonitor(_Monitor, tf_keras.callbacks.Callback):
        __doc__ = LossScaleMonitor.__doc__

    return TfKerasLossScaleMonitor

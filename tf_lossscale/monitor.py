"""`LossScaleMonitor` and `XlaChecks`: the Keras callbacks.

`LossScaleMonitor` puts the loss scale and the skipped steps in Keras' logs:

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

Cost: two small reads from the device per batch end (the scale and the
count), nothing in the train step itself. It also does what `XlaChecks`
does, so with it no `XlaChecks` is needed: it watches the fit's XLA step,
and its read of the scale carries out what that step left to the host (one
more small read per batch end, only once a step has been traced under
XLA). Under a `tf.distribute` strategy every replica holds the same values
(all replicas take the same skip decision), so the first replica's are
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

With `gradient_stats=True` two more entries come from inside the train step
(float16 layers' variable gradients at the step's loss scale, all replicas;
the last step of each call):

* `grad_underflow_share`: the share of gradient values that were zero or
  subnormal in float16 (below 2**-14). Without a float32 copy of the model
  a step cannot tell a value flushed to 0 from a true 0 (a dead ReLU, an
  unused embedding row): this share counts both, and
  `tf_lossscale.diagnose` separates them;
* `grad_headroom_log2`: log2(65504 / the largest gradient value), the
  doublings of the scale left before it overflows float16 (-inf on a step
  that overflowed). Activation gradients inside the backward pass can
  overflow before the variable gradients do.

That adds work to every step (a few reads of those gradients, and under a
strategy one all-gather of three floats per replica; measured in
`benchmarks/loss_scale_benchmark.py --only=stats`) and one more read per
batch end. The monitor re-makes the model's train function
(`make_train_function(force=True)`: one more trace) when training begins,
so the step records them, and again when it ends, so later steps do not.

tf-keras (Keras 2) models need a tf-keras callback: with
`TF_USE_LEGACY_KERAS=1` (when `tf.keras` is tf-keras) `LossScaleMonitor()`
and `XlaChecks()` are ones; with `tf_keras` imported directly, use
`LossScaleMonitor.for_tf_keras()` and `XlaChecks.for_tf_keras()`. Those
classes are created on first use, so Keras 3 users never import tf_keras.
"""

import contextlib
import functools

import keras

from tf_lossscale import float16_layers
from tf_lossscale import keras_compat
from tf_lossscale import optimizer_protocol
from tf_lossscale import step_gradient_stats
from tf_lossscale import validation
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
        f"{validation.summary(optimizer)} of type "
        f"{kind.__module__}.{kind.__qualname__}{hint}")


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


class _FitWatch:
    """The XLA watch a callback keeps over one `fit` (`xla_checks.Watch`).

    Live while the model still runs the train function it had when training
    began: `compile` replaces that function, so a watch that a fit which
    died left behind does not vouch for the step of a later fit.

    The model's train function is made anew (`make_train_function(force=
    True)`, public in Keras 3 and tf-keras), for a loss scale that needs the
    host on a model compiled with XLA, twice:

    * when the watch starts: the step is traced under this watch, even if a
      function made earlier was traced without one, or failed its first
      trace for want of one (TensorFlow may not trace that function again);
    * when the watch ends, if a step was traced under it: a later `fit`
      without a watcher then fails before its first step, naming the fixes,
      instead of running a compiled step that nobody checks. The cost: that
      later fit compiles its step again.
    """

    def __init__(self, model, optimizer):
        self._model = model
        if xla_checks.needs_watch(optimizer) and getattr(
                model, "jit_compile", False) is True:
            self._make_train_function()
        train_function = getattr(model, "train_function", None)
        self._watch = xla_checks.Watch(
            optimizer, is_live=lambda: getattr(
                model, "train_function", None) is train_function)
        self._watch.start()

    def _make_train_function(self):
        make_train_function = getattr(self._model, "make_train_function", None)
        if make_train_function is not None:
            make_train_function(force=True)

    def end(self, retrace=True):
        self._watch.end()
        if retrace and self._watch.traced:
            self._watch.traced = False
            self._make_train_function()

    @contextlib.contextmanager
    def ending_on_error(self):
        """Ends the watch if the body raises: Keras calls no
        `on_train_end` after a callback raised."""
        try:
            yield
        except BaseException:
            self.end()
            raise


def _rewatch(watch, model, optimizer, act=True):
    """A new `_FitWatch` of `model`, once `optimizer`'s record holds nothing
    (acting on it raises what unwatched calls left; `act=False` for a caller
    that reads the scale next, which acts); `watch`, left by a fit that died
    (no `on_train_end`), ends first."""
    if watch is not None:
        watch.end(retrace=False)
    if act:
        xla_checks.act(optimizer)
    return _FitWatch(model, optimizer)


class _XlaChecks:
    """`XlaChecks` for either framework's Callback base (the next class in
    the MRO)."""

    def __init__(self):
        super().__init__()
        self._watch = None

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        _check_optimizer(optimizer)
        self._watch = _rewatch(self._watch, self.model, optimizer)

    def on_train_batch_end(self, batch, logs=None):
        with self._watch.ending_on_error():
            xla_checks.act(self.model.optimizer)

    def on_train_end(self, logs=None):
        self._watch.end()


class XlaChecks(_XlaChecks, keras.callbacks.Callback):
    """Carries out, after each batch, what an XLA-compiled step cannot.

    Under XLA (`jit_compile`, Keras' default when a GPU is visible) a step can
    neither fail nor print, so `DynamicLossScale`'s state check,
    `on_min_loss_scale="raise"`/`"warn"` and `max_consecutive_skips` are
    carried out on the host, with the same errors and warnings. This
    callback (or a `LossScaleMonitor`, which does the same) watches `fit`:
    a loss scale with "warn", "raise" or `max_consecutive_skips` can only be
    traced under XLA while a watcher is live, and the callback acts after
    each executed call (`steps_per_execution` steps), with one small read.
    Without XLA it reads nothing and does nothing.

    The watch lasts from `on_train_begin` to `on_train_end`, and only while
    the model keeps the train function it began with. If a step was traced
    under it, `on_train_end` makes the model trace its step again
    (`make_train_function(force=True)`), so that a later `fit` without a
    watcher fails before its first step (naming the fixes) instead of
    running unchecked; that later fit compiles its step again.

    Raises:
      TypeError: at the start of training, the model's optimizer is not a
        `tf_lossscale.LossScaleOptimizer`.

    With `TF_USE_LEGACY_KERAS=1` the object made is a tf-keras callback
    (`for_tf_keras`).
    """

    def __new__(cls, *args, **kwargs):
        if cls is XlaChecks and optimizer_protocol.tf_keras_is_tf_keras():
            return cls.for_tf_keras(*args, **kwargs)
        return super().__new__(cls)

    @staticmethod
    def for_tf_keras():
        """The callback as a `tf_keras.callbacks.Callback`, for tf-keras'
        `fit`."""
        return _tf_keras_class(_XlaChecks, "TfKerasXlaChecks",
                               XlaChecks.__doc__)()


class _Monitor:
    """The monitor, for either framework's Callback base (the next class in
    the MRO); see `LossScaleMonitor`."""

    def __init__(self, verbose=False, gradient_stats=False):
        verbose = validation.boolean("verbose", verbose)
        gradient_stats = validation.boolean("gradient_stats", gradient_stats)
        super().__init__()
        self.verbose = verbose
        self.gradient_stats = gradient_stats
        self._stats = None
        self._optimizer = None
        self._scale = None
        self._skipped = None
        self._step = 0
        self._epoch_first_step = 0
        self._burst = None
        self._watch = None

    def _read(self):
        # One device read each, and nothing else: this runs after every batch.
        # Reading the scale first acts on what XLA steps left to the host
        # (one more small read, once a step was traced under XLA).
        return (float(self._optimizer.loss_scale()),
                int(self._optimizer.skipped_steps))

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        _check_optimizer(optimizer)
        self._optimizer = optimizer
        self._scale, self._skipped = self._read()
        self._watch = _rewatch(self._watch, self.model, optimizer, act=False)
        self._step = 0
        self._epoch_first_step = 0
        self._burst = None
        if self.gradient_stats:
            self._attach_stats()

    def _attach_stats(self):
        # A train function traced before now has no statistics in it: the
        # step must be traced again, through Keras' public hook.
        self._stats = step_gradient_stats.attach(
            self._optimizer, float16_layers.float16_variables(self.model),
            self.model.distribute_strategy)
        self.model.make_train_function(force=True)

    def _detach_stats(self):
        if self._stats is not None:
            self._stats = None
            step_gradient_stats.detach(self._optimizer)
            self.model.make_train_function(force=True)

    def _log_stats(self, logs):
        if self._stats is not None and logs is not None:
            (logs["grad_underflow_share"],
             logs["grad_headroom_log2"]) = self._stats.read()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_first_step = self._step

    def on_train_batch_end(self, batch, logs=None):
        # Under XLA the step's failures and warnings come first, as they
        # would without XLA (see XlaChecks).
        with self._watch.ending_on_error():
            scale, skipped = self._read()
        if logs is not None:
            logs["loss_scale"] = scale
            logs["skipped_steps"] = skipped
        self._log_stats(logs)
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
            with self._watch.ending_on_error():
                logs["loss_scale"], logs["skipped_steps"] = self._read()
        self._log_stats(logs)

    def on_train_end(self, logs=None):
        self._watch.end()
        self._detach_stats()
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
      gradient_stats: if True, also add `grad_underflow_share` and
        `grad_headroom_log2`, measured in the train step (which costs that
        step some work; see the module docstring).

    Raises:
      TypeError: `verbose` or `gradient_stats` is not a bool; at the start
        of training, the model's optimizer is not a
        `tf_lossscale.LossScaleOptimizer`.

    With `TF_USE_LEGACY_KERAS=1` the object made is a tf-keras callback
    (`for_tf_keras`).
    """

    def __new__(cls, *args, **kwargs):
        if cls is LossScaleMonitor and optimizer_protocol.tf_keras_is_tf_keras():
            return cls.for_tf_keras(*args, **kwargs)
        return super().__new__(cls)

    @staticmethod
    def for_tf_keras(verbose=False, gradient_stats=False):
        """The monitor as a `tf_keras.callbacks.Callback`, for tf-keras'
        `fit`."""
        return _tf_keras_class(_Monitor, "TfKerasLossScaleMonitor",
                               LossScaleMonitor.__doc__)(verbose,
                                                         gradient_stats)


@functools.lru_cache(maxsize=None)
def _tf_keras_class(mixin, name, doc):
    """`mixin` on tf-keras' Callback base; made on first use, so Keras 3
    users never import tf_keras."""
    import tf_keras  # pylint: disable=g-import-not-at-top

    return type(name, (mixin, tf_keras.callbacks.Callback),
                {"__doc__": doc, "__module__": __name__})

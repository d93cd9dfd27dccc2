"""`LossScaleMonitor`: the Keras callback that logs the loss scale (and
`XlaChecks`, from `tf_lossscale.monitor.xla_callback`).

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

import keras

from tf_lossscale.ops import float16
from tf_lossscale.monitor import keras_compat
from tf_lossscale.step import optimizer_protocol
from tf_lossscale.monitor import skip_reporting
from tf_lossscale.monitor import gradient_stats
from tf_lossscale._internal import checks
from tf_lossscale.monitor import xla_callback

# The burst limits of the verbose lines (module docstring), read when
# training begins.
BURST_GAP_STEPS = skip_reporting.BURST_GAP_STEPS
BURST_SUMMARY_SKIPS = skip_reporting.BURST_SUMMARY_SKIPS
# Where it was before 0.4.
XlaChecks = xla_callback.XlaChecks


class _Monitor:
    """The monitor, for either framework's Callback base (the next class in
    the MRO); see `LossScaleMonitor`."""

    def __init__(self, verbose=False, gradient_stats=False):
        verbose = checks.boolean("verbose", verbose)
        gradient_stats = checks.boolean("gradient_stats", gradient_stats)
        super().__init__()
        self.verbose = verbose
        self.gradient_stats = gradient_stats
        self._stats = None
        self._optimizer = None
        self._scale = None
        self._skipped = None
        self._step = 0
        self._epoch_first_step = 0
        self._reporter = None
        self._watch = None

    def _read(self):
        # One device read each, and nothing else: this runs after every batch.
        # Reading the scale first acts on what XLA steps left to the host
        # (one more small read, once a step was traced under XLA).
        return (float(self._optimizer.loss_scale()),
                int(self._optimizer.skipped_steps))

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        xla_callback.check_optimizer(optimizer)
        self._optimizer = optimizer
        self._scale, self._skipped = self._read()
        self._watch = xla_callback.rewatch(
            self._watch, self.model, optimizer, act=False)
        self._step = 0
        self._epoch_first_step = 0
        self._reporter = skip_reporting.SkipReporter(
            optimizer, BURST_GAP_STEPS, BURST_SUMMARY_SKIPS)
        if self.gradient_stats:
            self._attach_stats()

    def _attach_stats(self):
        # A train function traced before now has no statistics in it: the
        # step must be traced again, through Keras' public hook.
        self._stats = gradient_stats.attach(
            self._optimizer, float16.float16_variables(self.model),
            self.model.distribute_strategy)
        self.model.make_train_function(force=True)

    def _detach_stats(self):
        if self._stats is not None:
            self._stats = None
            gradient_stats.detach(self._optimizer)
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
            self._reporter.report(skipped - self._skipped, first_step,
                                  self._step, self._scale, scale)
        self._scale, self._skipped = scale, skipped

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            with self._watch.ending_on_error():
                logs["loss_scale"], logs["skipped_steps"] = self._read()
        self._log_stats(logs)

    def on_train_end(self, logs=None):
        self._watch.end()
        self._detach_stats()
        if self._reporter is not None:
            self._reporter.end()


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
        cls = xla_callback.tf_keras_class(
            _Monitor, "TfKerasLossScaleMonitor", LossScaleMonitor.__doc__)
        return cls(verbose, gradient_stats)


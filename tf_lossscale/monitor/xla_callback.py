"""`XlaChecks`: the Keras callback that carries out, after each batch, what
an XLA-compiled step cannot (`tf_lossscale.loss_scales.xla_checks`), and the watch over
one `fit` it shares with `LossScaleMonitor` (`tf_lossscale.monitor`).

tf-keras (Keras 2) models need a tf-keras callback: with
`TF_USE_LEGACY_KERAS=1` `XlaChecks()` is one; with `tf_keras` imported
directly, use `XlaChecks.for_tf_keras()`. Those classes are created on
first use, so Keras 3 users never import tf_keras.
"""

import contextlib
import functools

import keras

from tf_lossscale.step import optimizer_protocol
from tf_lossscale._internal import checks
from tf_lossscale.loss_scales import xla_checks


def check_optimizer(optimizer):
    """Raises TypeError unless `optimizer` is a tf_lossscale wrapper, naming
    the fix when Keras' own wrapper is what `compile` left."""
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
        f"{checks.summary(optimizer)} of type "
        f"{kind.__module__}.{kind.__qualname__}{hint}")


class FitWatch:
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


def rewatch(watch, model, optimizer, act=True):
    """A new `_FitWatch` of `model`, once `optimizer`'s record holds nothing
    (acting on it raises what unwatched calls left; `act=False` for a caller
    that reads the scale next, which acts); `watch`, left by a fit that died
    (no `on_train_end`), ends first."""
    if watch is not None:
        watch.end(retrace=False)
    if act:
        xla_checks.act(optimizer)
    return FitWatch(model, optimizer)


class _XlaChecks:
    """`XlaChecks` for either framework's Callback base (the next class in
    the MRO)."""

    def __init__(self):
        super().__init__()
        self._watch = None

    def on_train_begin(self, logs=None):
        optimizer = getattr(self.model, "optimizer", None)
        check_optimizer(optimizer)
        self._watch = rewatch(self._watch, self.model, optimizer)

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
        return tf_keras_class(_XlaChecks, "TfKerasXlaChecks",
                              XlaChecks.__doc__)()


@functools.lru_cache(maxsize=None)
def tf_keras_class(mixin, name, doc):
    """`mixin` on tf-keras' Callback base; made on first use, so Keras 3
    users never import tf_keras."""
    import tf_keras  # pylint: disable=g-import-not-at-top

    return type(name, (mixin, tf_keras.callbacks.Callback),
                {"__doc__": doc, "__module__": __name__})

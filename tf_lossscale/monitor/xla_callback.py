"""`XlaChecks`, the Keras callback that carries out after each batch what an
XLA-compiled step cannot, and what it shares with `LossScaleMonitor`: the
optimizer check, the watch over one `fit` (docs/guides/xla.md), and the
tf-keras twin of each."""

import contextlib
import functools

import keras

from tf_lossscale._internal import checks
from tf_lossscale.loss_scales import xla_checks
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.step import optimizer_protocol


def check_optimizer(optimizer):
    """Returns `optimizer` if a tf_lossscale wrapper, else raises TypeError,
    naming the fix when Keras' own wrapper is what `compile` left."""
    if isinstance(optimizer, optimizer_protocol.ScaledLossProtocol):
        return optimizer
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


class EitherKeras:
    """Base of a callback class `C(Code, EitherKeras, keras.callbacks.Callback)`
    whose behaviour is all in `Code`: when `tf.keras` is tf-keras
    (`TF_USE_LEGACY_KERAS=1`), `C(...)` is `C.for_tf_keras(...)`."""

    def __new__(cls, *args, **kwargs):
        if (EitherKeras in cls.__bases__
                and optimizer_protocol.tf_keras_is_tf_keras()):
            return cls.for_tf_keras(*args, **kwargs)
        return super().__new__(cls)

    @classmethod
    def for_tf_keras(cls, *args, **kwargs):
        """This callback as a `tf_keras.callbacks.Callback`, for tf-keras'
        `fit` (with `tf_keras` imported directly); same arguments."""
        public = next(c for c in cls.__mro__ if EitherKeras in c.__bases__)
        return _tf_keras_twin(public)(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _tf_keras_twin(public):
    # Made on first use, so Keras 3 users never import tf_keras.
    import tf_keras  # pylint: disable=g-import-not-at-top

    return type(f"TfKeras{public.__name__}",
                (public.__bases__[0], tf_keras.callbacks.Callback),
                {"__doc__": public.__doc__, "__module__": public.__module__})


class FitWatcher:
    """`XlaChecks` on either Keras' Callback (the next class in the MRO), and
    `LossScaleMonitor`'s base: an XLA watch over each `fit`, live while the
    model keeps the train function it began with. Where the loss scale needs
    the host, a model compiled with XLA makes its train function anew when
    the watch starts (to trace the step under it) and when it ends after
    such a trace (so that an unwatched `fit` fails before its first step)."""

    def __init__(self):
        super().__init__()
        self._watch = None

    def _begin(self, act=True):
        """Checks the model's optimizer, watches the fit and returns the
        optimizer; with `act`, first acts on what unwatched calls left in
        its record (raising it)."""
        model = self.model
        optimizer = check_optimizer(getattr(model, "optimizer", None))
        if self._watch is not None:  # Left by a fit that died.
            self._watch.end()
        if act:
            xla_checks.act(optimizer)
        record = xla_record.record_of(optimizer)
        if record is not None and record.needs_host and getattr(
                model, "jit_compile", False) is True:
            model.make_train_function(force=True)
        train_function = getattr(model, "train_function", None)
        self._watch = xla_checks.Watch(
            optimizer, is_live=lambda: getattr(
                model, "train_function", None) is train_function)
        self._watch.start()
        return optimizer

    def _end(self):
        self._watch.end()
        if self._watch.traced:
            self._watch.traced = False
            self.model.make_train_function(force=True)

    @contextlib.contextmanager
    def _ending_on_error(self):
        # Keras calls no on_train_end after a callback raised.
        try:
            yield
        except BaseException:
            self._end()
            raise

    def on_train_begin(self, logs=None):
        self._begin()

    def on_train_batch_end(self, batch, logs=None):
        with self._ending_on_error():
            xla_checks.act(self.model.optimizer)

    def on_train_end(self, logs=None):
        self._end()


class XlaChecks(FitWatcher, EitherKeras, keras.callbacks.Callback):
    """Carries out, after each batch, what an XLA-compiled step cannot.

    Under XLA a step can neither fail nor print, so `DynamicLossScale`'s state
    check, `on_min_loss_scale="raise"`/`"warn"` and `max_consecutive_skips`
    are carried out on the host, with the same errors and warnings, after
    each executed call of a watched `fit` (one small read; none without
    XLA). The XLA guide says how long a watch lasts and what it costs.

    Raises:
      TypeError: at the start of training, the model's optimizer is not a
        `tf_lossscale.LossScaleOptimizer`.

    With `TF_USE_LEGACY_KERAS=1` the object made is a tf-keras callback
    (`for_tf_keras`).
    """

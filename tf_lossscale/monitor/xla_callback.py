"""`XlaChecks`, the Keras callback that carries out after each batch what an
XLA-compiled step cannot (docs/guides/xla.md), and what it shares with
`LossScaleMonitor`."""

import contextlib
import functools

import keras

from tf_lossscale._internal import checks
from tf_lossscale.loss_scales import xla_checks
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.step import optimizer_protocol


def check_optimizer(optimizer, where="model.optimizer",
                    who="LossScaleMonitor"):
    """Returns `optimizer` if a tf_lossscale wrapper, else raises TypeError
    naming `who` needs it and `where` it was found."""
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
        f"{who} needs a model compiled with a "
        f"tf_lossscale.LossScaleOptimizer, but {where} is "
        f"{checks.summary(optimizer)} of type "
        f"{kind.__module__}.{kind.__qualname__}{hint}")


def optimizers_argument(optimizers):
    """`{label: optimizer}` of a callback's `optimizers` argument, each
    checked; None for None."""
    if optimizers is None:
        return None
    if isinstance(optimizers, dict):
        labelled = dict(optimizers)
    elif isinstance(optimizers, (list, tuple)):
        labelled = {getattr(opt, "name", str(i)): opt
                    for i, opt in enumerate(optimizers)}
    else:
        raise TypeError("optimizers must be a dict of labels to "
                        "tf_lossscale.LossScaleOptimizers or a list of them, "
                        f"got {checks.summary(optimizers)}")
    if not labelled or len(labelled) != len(optimizers):
        raise ValueError("optimizers must name at least one optimizer, each "
                         f"under a label of its own, got "
                         f"{checks.summary(optimizers)}")
    for label, optimizer in labelled.items():
        checks.of_type("an optimizers label", label, str, "a string")
        check_optimizer(optimizer, f"optimizers[{label!r}]")
    return labelled


class EitherKeras:
    """Base of a callback `C(Code, EitherKeras, keras.callbacks.Callback)`:
    when `tf.keras` is tf-keras, `C(...)` is `C.for_tf_keras(...)`."""

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
    """`XlaChecks` on either Keras' Callback (next in the MRO), and
    `LossScaleMonitor`'s base: an XLA watch over each `fit`, live while the
    model keeps the train function it began with (docs/guides/xla.md)."""

    def __init__(self, optimizers=None):
        super().__init__()
        self._given = optimizers_argument(optimizers)
        self._watches = []

    def _optimizers(self):
        """`{label: optimizer}`: those given, or `{None: model.optimizer}`."""
        if self._given is not None:
            return self._given
        return {None: check_optimizer(getattr(self.model, "optimizer", None))}

    def _begin(self, act=True):
        """Checks the optimizers, watches the fit and returns them as
        `{label: optimizer}`; with `act`, first acts on their records."""
        model = self.model
        optimizers = self._optimizers()
        for watch in self._watches:  # Left by a fit that died.
            watch.end()
        # One watch per loss scale: a group's optimizers share one.
        records = {}
        for optimizer in optimizers.values():
            records.setdefault(id(xla_record.record_of(optimizer)), optimizer)
        if act:
            for optimizer in records.values():
                xla_checks.act(optimizer)
        if any(record is not None and record.needs_host
               for record in map(xla_record.record_of, records.values())
               ) and getattr(model, "jit_compile", False) is True:
            model.make_train_function(force=True)
        train_function = getattr(model, "train_function", None)
        self._watches = [xla_checks.Watch(
            optimizer, is_live=lambda: getattr(
                model, "train_function", None) is train_function)
                         for optimizer in records.values()]
        for watch in self._watches:
            watch.start()
        return optimizers

    def _end(self):
        traced = False
        for watch in self._watches:
            watch.end()
            traced = traced or watch.traced
            watch.traced = False
        if traced:
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
            for optimizer in self._optimizers().values():
                xla_checks.act(optimizer)

    def on_train_end(self, logs=None):
        self._end()


class XlaChecks(FitWatcher, EitherKeras, keras.callbacks.Callback):
    """Carries out, after each batch, what an XLA-compiled step cannot.

    Under XLA a step can neither fail nor print, so `DynamicLossScale`'s state
    check, `on_min_loss_scale="raise"`/`"warn"` and `max_consecutive_skips`
    are carried out on the host, with the same errors and warnings, after
    each executed call of a watched `fit` (docs/guides/xla.md).

    Args:
      optimizers: None (the default: the model's optimizer), or the
        `tf_lossscale.LossScaleOptimizer`s a custom `train_step` steps, as a
        list or a dict of labels to optimizers (a GAN's two).

    Raises:
      TypeError: `optimizers` is none of the above or holds another
        optimizer; at the start of training, with `optimizers=None`, the
        model's optimizer is not a `tf_lossscale.LossScaleOptimizer`.
      ValueError: `optimizers` is empty or two of them have one label.

    With `TF_USE_LEGACY_KERAS=1` the object made is a tf-keras callback
    (`for_tf_keras`).
    """

"""Every way of running an XLA-compiled step, for Keras 3 and for tf-keras.

Not a test module: `tests/xla/test_xla_ways.py` runs each way here with
Keras 3 in the pytest process, and with tf-keras in the session's
`tf_keras_interpreter` (`run_with_tf_keras`). A way is a function of the
`keras` module in use; it raises AssertionError when the way misbehaves.

The loss scale asks for a failure (`DynamicLossScale(initial_loss_scale=2,
min_loss_scale=1, on_min_loss_scale="raise")`), and NaN batches drive it to
the floor: the first NaN step backs off to 1, the second is due to back off
at the floor and fails. Every way either

* stops with the error it gives without XLA, at the end of the call that
  held the failing step, with the weights of the last applied step
  (bit-identical: compared with the weights read after that step, in the
  same run), or
* fails before its first step with a RuntimeError naming the fixes,
  leaving weights and optimizer untouched.

Also: "warn" and `max_consecutive_skips`; the default `DynamicLossScale()`
in a bare custom XLA loop, against the framework's own wrapper; a corrupted
default scale, refused on the device and raised at the documented moments.
"""

import contextlib
import io
import os
import re
import tempfile
import threading

import numpy as np
import tensorflow as tf

from tests.helpers import training
import tf_lossscale

WAYS = {}
_BATCH = 8
_NAN = float("nan")
FLOOR_ERROR = (r"min_loss_scale=1\.0 \(current scale 1\); steps skipped in "
               r"a row for non-finite gradients: 2 \(on_min_loss_scale=raise\)")


def way(fn):
    WAYS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------
# Shared pieces.


def _pattern_data(pattern):
    """Batches of 8 for `pattern`: "F" finite, "N" a NaN in the batch; the
    same batch each time, but for the NaN."""
    x, y = training.normal_data(_BATCH)
    xs, ys = [], []
    for kind in pattern:
        batch = x.copy()
        if kind == "N":
            batch[0, 0] = _NAN
        xs.append(batch)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def _batches(pattern):
    x, y = _pattern_data(pattern)
    return [(tf.constant(x[i:i + _BATCH]), tf.constant(y[i:i + _BATCH]))
            for i in range(0, len(x), _BATCH)]


def _raising_scale(**kwargs):
    config = dict(initial_loss_scale=2, min_loss_scale=1,
                  on_min_loss_scale="raise")
    config.update(kwargs)
    return tf_lossscale.DynamicLossScale(**config)


def _optimizer(keras, loss_scale=None):
    return tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=_raising_scale() if loss_scale is None else loss_scale)


def _layers(keras):
    return [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)]


def _model(keras, cls=None):
    keras.utils.set_random_seed(0)
    return (cls or keras.Sequential)(_layers(keras))


def _compiled(keras, cls=None, loss_scale=None, **compile_args):
    model = _model(keras, cls)
    optimizer = _optimizer(keras, loss_scale)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True,
                  **compile_args)
    return model, optimizer


def _recorder(keras):
    """A callback that keeps the weights at every batch end; list it before
    the watcher, so it also sees the call whose end raises."""

    class Recorder(keras.callbacks.Callback):

        def __init__(self):
            super().__init__()
            self.weights = []

        def on_train_batch_end(self, batch, logs=None):
            self.weights.append(self.model.get_weights())

    return Recorder()


def _fit(model, pattern, callbacks=(), **kwargs):
    x, y = _pattern_data(pattern)
    return model.fit(x, y, batch_size=_BATCH, shuffle=False, verbose=0,
                     callbacks=list(callbacks), **kwargs)


def _count(variable):
    # Through a tensor: int() of a Keras variable fails under Mirrored.
    return int(tf.convert_to_tensor(variable))


def _same(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


def _optimizer_state(optimizer):
    return (_count(optimizer.iterations), _count(optimizer.skipped_steps),
            [v.numpy() for v in optimizer.loss_scale.variables])


def _assert_stops_at_the_floor(run):
    """Runs `run()`, which must raise the floor's InvalidArgumentError."""
    try:
        run()
    except tf.errors.InvalidArgumentError as error:
        assert re.search(FLOOR_ERROR, str(error)), str(error)
        return
    raise AssertionError("training went on past the floor")


def _assert_fails_before_its_first_step(run, model, optimizer):
    weights = model.get_weights()
    state = _optimizer_state(optimizer)
    try:
        run()
    except RuntimeError as error:
        message = str(error)
        for fix in ("tf_lossscale.XlaChecks()", "LossScaleMonitor()",
                    "with_xla_checks(step, optimizer)", "jit_compile=False"):
            assert fix in message, message
    else:
        raise AssertionError("an unwatched XLA step ran")
    _same(model.get_weights(), weights)
    after = _optimizer_state(optimizer)
    assert after[:2] == state[:2], (after, state)
    _same(after[2], state[2])


def _assert_fit_stops(keras, model, optimizer, watcher,
                      steps_per_execution=1, before_watcher=()):
    """A fit of finite steps filling the first call, then N, N (the floor:
    fails), F, F: stopped at the end of the second call, with the first
    call's weights, as without XLA (the failing step counted in the scale's
    state, not as a skipped step)."""
    recorder = _recorder(keras)
    pattern = "F" * steps_per_execution + "NNFF"
    iterations = _count(optimizer.iterations)
    _assert_stops_at_the_floor(lambda: _fit(
        model, pattern, [recorder, *before_watcher, watcher]))
    failing_call = 3 if steps_per_execution == 1 else 2
    assert len(recorder.weights) == failing_call, len(recorder.weights)
    _same(model.get_weights(), recorder.weights[0])
    assert _count(optimizer.iterations) == iterations + steps_per_execution
    consecutive_skips = optimizer.loss_scale.variables[-1].numpy()
    assert (float(optimizer.loss_scale.variables[0].numpy()),
            consecutive_skips) == (1.0, 2)


# ---------------------------------------------------------------------------
# fit and its watchers.


@way
def fit_with_xla_checks_and_fits_before_and_after_it(keras):
    model, optimizer = _compiled(keras)
    # No watcher: the step fails before it runs, naming the fixes.
    _assert_fails_before_its_first_step(lambda: _fit(model, "FF"), model,
                                        optimizer)
    _assert_fit_stops(keras, model, optimizer, tf_lossscale.XlaChecks())
    # The watch ended when XlaChecks raised: a fit without it does not run
    # the step traced under it.
    _assert_fails_before_its_first_step(lambda: _fit(model, "FF"), model,
                                        optimizer)
    # A watched fit that ends normally, then one without a watcher.
    _fit(model, "FF", [tf_lossscale.XlaChecks()])
    assert _count(optimizer.iterations) == 3
    _assert_fails_before_its_first_step(lambda: _fit(model, "FF"), model,
                                        optimizer)


@way
def fit_of_4_steps_per_call_with_the_monitor_and_a_fit_after_it(keras):
    model, optimizer = _compiled(keras, steps_per_execution=4)
    _assert_fit_stops(keras, model, optimizer,
                      tf_lossscale.LossScaleMonitor(), steps_per_execution=4)
    _assert_fails_before_its_first_step(lambda: _fit(model, "FFFF"), model,
                                        optimizer)


def _own_step_model(keras):

    class OwnStep(keras.Sequential):
        """Its own train_step (TF 2.x protocol) and a fit of its own."""

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
                scaled = self.optimizer.get_scaled_loss(loss)
            grads = self.optimizer.get_unscaled_gradients(
                tape.gradient(scaled, self.trainable_variables))
            self.optimizer.apply_gradients(
                zip(grads, self.trainable_variables))
            return {"loss": loss}

        def fit(self, *args, **kwargs):  # pylint: disable=useless-parent-delegation
            return super().fit(*args, **kwargs)

    return OwnStep


@way
def model_with_its_own_train_step_and_a_fit_calling_super_fit(keras):
    model, optimizer = _compiled(keras, cls=_own_step_model(keras))
    _assert_fails_before_its_first_step(lambda: _fit(model, "FF"), model,
                                        optimizer)
    _assert_fit_stops(keras, model, optimizer, tf_lossscale.XlaChecks())


@way
def fit_from_another_thread(keras):
    model, optimizer = _compiled(keras)
    errors = []

    def fit_and_stop():
        try:
            _assert_fit_stops(keras, model, optimizer,
                              tf_lossscale.XlaChecks())
        except BaseException as error:  # pylint: disable=broad-except
            errors.append(error)

    thread = threading.Thread(target=fit_and_stop)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


@way
def model_loaded_from_a_keras_file(keras):
    model, _ = _compiled(keras)
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    if loaded.jit_compile is not True:  # tf-keras keeps no jit_compile.
        loaded.compile(optimizer=loaded.optimizer, loss="mse",
                       jit_compile=True)
    optimizer = loaded.optimizer
    assert optimizer.loss_scale.get_config()["on_min_loss_scale"] == "raise"
    _assert_fails_before_its_first_step(lambda: _fit(loaded, "FF"), loaded,
                                        optimizer)
    _assert_fit_stops(keras, loaded, optimizer, tf_lossscale.XlaChecks())


@way
def fit_after_one_that_died_from_another_callback(keras):
    model, optimizer = _compiled(keras)

    class Dies(keras.callbacks.Callback):

        def on_train_batch_end(self, batch, logs=None):
            raise ValueError("another callback failed")

    try:
        _fit(model, "FF", [Dies(), tf_lossscale.XlaChecks()])
    except ValueError:
        pass
    else:
        raise AssertionError("the callback did not raise")
    weights = model.get_weights()
    assert _count(optimizer.iterations) == 1
    # No recompile: the step traced under the died fit's watch runs without
    # one. Never silent: the failing step halts every later one, and the end
    # of fit raises (finalize_variable_values).
    _assert_stops_at_the_floor(lambda: _fit(model, "NNFF"))
    _same(model.get_weights(), weights)
    assert _count(optimizer.iterations) == 1
    # After compile, the died fit's watch no longer counts: fails before
    # its first step.
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    _assert_fails_before_its_first_step(lambda: _fit(model, "FF"), model,
                                        optimizer)
    for variable, value in zip(optimizer.loss_scale.variables, (2.0, 0, 0)):
        variable.assign(value)  # Off the floor again.
    _assert_fit_stops(keras, model, optimizer, tf_lossscale.XlaChecks())


def _under(keras, strategy):
    with strategy.scope():
        model, optimizer = _compiled(keras)
    _assert_fails_before_its_first_step(lambda: _fit(model, "FF"), model,
                                        optimizer)
    _assert_fit_stops(keras, model, optimizer, tf_lossscale.XlaChecks())


@way
def fit_under_one_device_strategy(keras):
    _under(keras, tf.distribute.OneDeviceStrategy("/cpu:0"))


@way
def fit_under_one_device_mirrored_strategy(keras):
    _under(keras, training.mirrored(1))


@way
def fit_warns_at_the_floor_then_stops_at_max_consecutive_skips(keras):
    loss_scale = _raising_scale(on_min_loss_scale="warn",
                                max_consecutive_skips=3)
    model, optimizer = _compiled(keras, loss_scale=loss_scale)
    recorder = _recorder(keras)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        _fit(model, "F", [tf_lossscale.XlaChecks()])
        weights = model.get_weights()
        try:
            _fit(model, "NNNFF", [recorder, tf_lossscale.XlaChecks()])
        except tf.errors.InvalidArgumentError as error:
            assert re.search(r"in a row for non-finite gradients: 3, the "
                             r"limit set by max_consecutive_skips=3; current "
                             r"loss scale 1\b", str(error)), str(error)
        else:
            raise AssertionError("no error at max_consecutive_skips")
    lines = [line for line in stderr.getvalue().splitlines()
             if line.startswith("tf_lossscale WARNING:")]
    # The second and third NaN steps are at the floor: one line each, after
    # its own call.
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["2", "3"], lines
    assert len(recorder.weights) == 3
    _same(model.get_weights(), weights)


# ---------------------------------------------------------------------------
# train_on_batch, custom loops, a trainer of one's own.


@way
def train_on_batch_without_and_with_with_xla_checks(keras):
    model, optimizer = _compiled(keras)
    x, y = _pattern_data("F")
    _assert_fails_before_its_first_step(lambda: model.train_on_batch(x, y),
                                        model, optimizer)
    train_on_batch = tf_lossscale.with_xla_checks(model.train_on_batch,
                                                  optimizer)
    train_on_batch(x, y)
    weights = model.get_weights()
    x_nan, _ = _pattern_data("N")
    train_on_batch(x_nan, y)  # 2 -> 1
    _assert_stops_at_the_floor(lambda: train_on_batch(x_nan, y))
    _same(model.get_weights(), weights)
    assert _count(optimizer.iterations) == 1


def _custom_step(model, optimizer, keras3_protocol=False):
    """An XLA step: TF 2.x protocol (get_scaled_loss, get_unscaled_gradients)
    or Keras 3's (scale_loss, then the optimizer unscales)."""

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            if keras3_protocol:
                scaled = optimizer.scale_loss(loss)
            else:
                scaled = optimizer.get_scaled_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        if not keras3_protocol:
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return tf.function(step, jit_compile=True)


class _Trainer:
    """A trainer of one's own: a `fit` method, an `optimizer` attribute."""

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.step = _custom_step(model, optimizer)

    def fit(self, batches, step=None):
        for x, y in batches:
            (step or self.step)(x, y)


@way
def own_trainer_class_with_a_fit_method(keras):
    model, optimizer = _model(keras), _optimizer(keras)
    trainer = _Trainer(model, optimizer)
    _assert_fails_before_its_first_step(
        lambda: trainer.fit(_batches("FF")), model, optimizer)
    checked = tf_lossscale.with_xla_checks(trainer.step, optimizer)
    trainer.fit(_batches("F"), checked)
    weights = model.get_weights()
    _assert_stops_at_the_floor(lambda: trainer.fit(_batches("NNF"), checked))
    _same(model.get_weights(), weights)
    assert _count(optimizer.iterations) == 1


@way
def custom_loop_without_and_with_with_xla_checks(keras):
    # Three steps per call: the failing step halts the finite one after it.
    model, optimizer = _model(keras), _optimizer(keras)
    one_step = _custom_step(model, optimizer).python_function

    def three_steps(x_1, x_2, x_3, y):
        for x in (x_1, x_2, x_3):
            one_step(x, y)

    step = tf.function(three_steps, jit_compile=True)
    (x, y), (x_nan, _) = _batches("F") + _batches("N")
    _assert_fails_before_its_first_step(lambda: step(x, x, x, y), model,
                                        optimizer)
    # The same tf.function, now watched: it traces again.
    checked = tf_lossscale.with_xla_checks(step, optimizer)
    checked(x, x, x, y)
    weights = model.get_weights()
    _assert_stops_at_the_floor(lambda: checked(x_nan, x_nan, x, y))
    _same(model.get_weights(), weights)
    assert _count(optimizer.iterations) == 3
    checked(x, x, x, y)  # Resumed after the error, as without XLA.
    assert _count(optimizer.iterations) == 6


# ---------------------------------------------------------------------------
# The default DynamicLossScale(): no watcher needed.


def _own_wrapper(keras, inner):
    """The framework's own dynamic loss scale optimizer, default arguments."""
    if hasattr(keras.optimizers, "LossScaleOptimizer"):  # Keras 3
        return keras.optimizers.LossScaleOptimizer(inner)
    return keras.mixed_precision.LossScaleOptimizer(inner)


@way
def default_scale_trains_in_a_bare_xla_loop_as_the_own_wrapper_does(keras):
    batches = _batches("FFNFFNNF")
    keras3 = hasattr(keras.optimizers, "LossScaleOptimizer")
    results = []
    for make in (lambda inner: tf_lossscale.LossScaleOptimizer(inner),
                 lambda inner: _own_wrapper(keras, inner)):
        model = _model(keras)
        optimizer = make(keras.optimizers.SGD(0.1))
        # As the framework's own wrapper is driven (Keras 3's has no
        # get_scaled_loss).
        step = _custom_step(model, optimizer, keras3_protocol=keras3)
        for x, y in batches:
            step(x, y)
        # tf-keras' own wrapper has no dynamic_scale, Keras 3's no loss_scale.
        scale = optimizer.dynamic_scale if keras3 else optimizer.loss_scale
        scale = scale() if callable(scale) else scale
        results.append((model.get_weights(),
                        _count(optimizer.inner_optimizer.iterations),
                        float(tf.convert_to_tensor(scale))))
    (ours, ours_iterations, ours_scale), (theirs, their_iterations,
                                          their_scale) = results
    # tf-keras' own wrapper counts skipped steps in iterations too (8).
    assert ours_iterations == 5 and their_iterations in (5, 8), results
    assert ours_scale == their_scale == 2.0**12, results
    for a, b in zip(ours, theirs):
        # The same arithmetic, but XLA may fuse the two steps' ops
        # differently: with TF 2.16 and Keras 3.10 a small weight came out
        # 1.5e-8 apart after five steps. Within one float32 ulp of the
        # largest weights (about 0.8, ulp 6e-8).
        np.testing.assert_allclose(a, b, rtol=2e-7, atol=6e-8)


@way
def corrupted_default_scale_is_refused_and_raised_when_documented(keras):
    x, y = _pattern_data("F")
    # A custom loop: the refused steps change nothing; the next eager read
    # of the scale raises, naming the value.
    model, optimizer = _model(keras), _optimizer(keras, "dynamic")
    step = _custom_step(model, optimizer)
    step(x, y)
    weights = model.get_weights()
    optimizer.loss_scale.variables[0].assign(_NAN)
    step(x, y)
    step(x, y)
    _same(model.get_weights(), weights)
    assert _count(optimizer.iterations) == 1
    for read in (lambda: optimizer.loss_scale(),
                 lambda: optimizer.dynamic_scale):
        step(x, y)
        try:
            read()
        except tf.errors.InvalidArgumentError as error:
            assert "current_loss_scale=nan" in str(error), str(error)
        else:
            raise AssertionError("the refused state was not raised")
    _same(model.get_weights(), weights)

    # fit without a watcher: the end of fit raises.
    model, optimizer = _compiled(keras, loss_scale="dynamic")
    _fit(model, "F")
    weights = model.get_weights()
    optimizer.loss_scale.variables[0].assign(_NAN)
    for callbacks, batch_ends in (([], None),
                                  ([tf_lossscale.XlaChecks()], 1)):
        recorder = _recorder(keras)
        try:
            _fit(model, "FFF", [recorder, *callbacks])
        except tf.errors.InvalidArgumentError as error:
            assert "current_loss_scale=nan" in str(error), str(error)
        else:
            raise AssertionError("the refused state was not raised")
        # Without a watcher at the end of fit; with one at the first batch
        # end.
        assert len(recorder.weights) == (batch_ends or 3)
        _same(model.get_weights(), weights)
        assert _count(optimizer.iterations) == 1


def run_with_tf_keras(name):
    """Runs the way `name` with `tf.keras`, in a process where that is
    tf-keras (`TF_USE_LEGACY_KERAS=1`)."""
    assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
    WAYS[name](tf.keras)

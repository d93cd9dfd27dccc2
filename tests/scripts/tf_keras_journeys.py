"""tf-keras users' journeys with `tf_lossscale`, in a tf-keras process.

Not a test: `tests/tf_keras/test_tf_keras_journeys.py` runs each journey in
the session's `tf_keras_interpreter` (`TF_USE_LEGACY_KERAS=1`, so `tf.keras`
is tf-keras, Keras 2, and the CPU split into 4 logical devices for
MirroredStrategy) with `run(name)`, one test each. Each journey is written as
a tf-keras user would write it (`tf.keras...`,
`tf_lossscale.LossScaleOptimizer(tf.keras.optimizers.Adam(), loss_scale=...)`)
and checks its own results, computed in this process.
"""

import contextlib
import csv
import functools
import os
import tempfile

import numpy as np
import tensorflow as tf

import tf_lossscale
from tests.helpers import gan
from tests.helpers import reference_oracle
from tests.helpers import training

keras = tf.keras
JOURNEYS = {}
_TMP = tempfile.mkdtemp()


def journey(fn):
    JOURNEYS[fn.__name__] = fn
    return fn


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(1, dtype="float32"),
    ])


def _ours(inner, initial=2.0**10, period=1000):
    return tf_lossscale.LossScaleOptimizer(
        inner, loss_scale=tf_lossscale.DynamicLossScale(initial, period))


def _fit(optimizer, nan_batches=(), callbacks=(), batches=6, model=None):
    model = model or _model()
    model.compile(optimizer=optimizer, loss="mse")
    x, y = training.summed_data(8, batches, nan_batches=nan_batches, nan_row=-1)
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history


def _close(a, b, rtol=1e-3, atol=1e-4):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol,
                                   atol=atol)


def _optimizer_values(optimizer):
    variables = optimizer.inner_optimizer.variables
    variables = variables() if callable(variables) else variables
    return [v.numpy() for v in variables]


@journey
def wrapping_tf_keras_and_legacy_optimizers_gives_a_tf_keras_wrapper():
    assert keras.__name__.startswith("tf_keras"), keras.__name__
    for inner in (keras.optimizers.Adam(), keras.optimizers.legacy.Adam()):
        optimizer = tf_lossscale.LossScaleOptimizer(inner, loss_scale=128)
        assert isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)
        assert optimizer.inner_optimizer is inner


@journey
def compile_under_mixed_float16_keeps_the_wrapper_without_double_scaling():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for make_inner in (lambda: keras.optimizers.SGD(0.05),
                           lambda: keras.optimizers.legacy.SGD(0.05)):
            optimizer = _ours(make_inner())
            model, _ = _fit(optimizer)
            assert model.optimizer is optimizer
            theirs = keras.mixed_precision.LossScaleOptimizer(
                make_inner(), initial_scale=2.0**10)
            reference, _ = _fit(theirs)
            # The same training as with tf-keras' own wrapper: the loss was
            # scaled once and the gradients unscaled once.
            _close(model.get_weights(), reference.get_weights())
            assert int(optimizer.iterations) == 6
    finally:
        keras.mixed_precision.set_global_policy("float32")


@journey
def fit_skips_a_non_finite_step_leaving_weights_slots_and_iterations():
    for make_inner in (lambda: keras.optimizers.Adam(0.01),
                       lambda: keras.optimizers.legacy.Adam(0.01)):
        skipped, _ = _fit(_ours(make_inner()), nan_batches=[2])
        optimizer = skipped.optimizer
        assert int(optimizer.skipped_steps) == 1
        assert int(optimizer.iterations) == 5
        assert float(optimizer.loss_scale()) == 2.0**9
        # Training the five finite batches only gives the same state.
        x, y = training.summed_data(8, 6, nan_batches=[2], nan_row=-1)
        keep = np.isfinite(x).all(axis=1)
        keep[16:24] = False
        clean = _model()
        clean.compile(optimizer=_ours(make_inner()), loss="mse")
        clean.fit(x[keep], y[keep], batch_size=8, shuffle=False, verbose=0)
        _close(skipped.get_weights(), clean.get_weights(), 1e-5, 1e-6)
        _close(_optimizer_values(optimizer),
               _optimizer_values(clean.optimizer), 1e-5, 1e-6)


@journey
def custom_loop_and_minimize_skip_non_finite_steps():
    for make_inner in (lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                       lambda: keras.optimizers.legacy.SGD(0.1, momentum=0.9)):
        model, optimizer = _model(), _ours(make_inner(), initial=8.0)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
                scaled = optimizer.get_scaled_loss(loss)
            grads = optimizer.get_unscaled_gradients(
                tape.gradient(scaled, model.trainable_variables))
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        x, y = training.summed_data(8, 3, nan_batches=[1], nan_row=-1)
        step(x[:8], y[:8])
        before = [v.numpy() for v in model.weights] + _optimizer_values(
            optimizer)
        step(x[8:16], y[8:16])
        after = [v.numpy() for v in model.weights] + _optimizer_values(
            optimizer)
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)
        optimizer.minimize(
            lambda: tf.reduce_mean(tf.square(model(x[8:16]) - y[8:16])),
            model.trainable_variables)
        assert int(optimizer.skipped_steps) == 2
        optimizer.minimize(
            lambda: tf.reduce_mean(tf.square(model(x[16:]) - y[16:])),
            model.trainable_variables)
        assert int(optimizer.iterations) == 2
        assert float(optimizer.loss_scale()) == 2.0


@journey
def fit_under_mirrored_strategy_skips_a_nan_on_one_replica():
    strategy = training.mirrored(4)
    for make_inner in (lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                       lambda: keras.optimizers.legacy.SGD(0.05,
                                                           momentum=0.9)):
        with strategy.scope():
            optimizer = _ours(make_inner())
            model = _model()
            # The NaN is the last sample of batch 2: replica 3's part.
            _fit(optimizer, nan_batches=[2], model=model)
        assert int(optimizer.skipped_steps) == 1
        assert int(optimizer.iterations.numpy()) == 5
        assert all(np.isfinite(w).all() for w in model.get_weights())


def _trained_for_saving(make_inner):
    model, _ = _fit(_ours(make_inner(), initial=2.0**12, period=3),
                    nan_batches=[1, 4])
    optimizer = model.optimizer
    state = (float(optimizer.loss_scale()), int(optimizer.dynamic_counter),
             int(optimizer.skipped_steps))
    assert state == (2.0**10, 1, 2), state
    return model, state


@journey
def keras_h5_and_saved_model_files_keep_the_wrapper_and_the_scale():
    kinds = {"optimizer": lambda: keras.optimizers.Adam(0.01),
             "legacy": lambda: keras.optimizers.legacy.Adam(0.01)}
    for kind, make_inner in kinds.items():
        model, state = _trained_for_saving(make_inner)
        # tf-keras writes no state of legacy optimizers into .keras files.
        formats = ("model.h5", "saved_model") + (
            ("model.keras",) if kind == "optimizer" else ())
        for name in formats:
            path = os.path.join(_TMP, f"{kind}_{name}")
            model.save(path)
            loaded = keras.models.load_model(path)
            optimizer = loaded.optimizer
            assert type(optimizer) is type(model.optimizer), (name, optimizer)
            if name == "saved_model":
                # tf-keras' load_model compiles a fresh optimizer from a
                # SavedModel, its own wrapper's too; the state is in the
                # SavedModel's variables, a checkpoint of the model.
                if kind == "legacy":
                    optimizer._create_all_weights(loaded.trainable_variables)  # pylint: disable=protected-access
                else:
                    optimizer.build(loaded.trainable_variables)
                tf.train.Checkpoint(root=loaded).restore(os.path.join(
                    path, "variables", "variables")).expect_partial()
            assert (float(optimizer.loss_scale()),
                    int(optimizer.dynamic_counter),
                    int(optimizer.skipped_steps)) == state, (kind, name)
            _close(_optimizer_values(optimizer),
                   _optimizer_values(model.optimizer), 0, 0)


@journey
def tf_keras_code_reads_the_scale_and_asks_isinstance():
    # What tf-keras code does with its own wrapper, with ours.
    class LogScale(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["scale"] = keras.backend.get_value(
                self.model.optimizer.loss_scale)

    model, history = _fit(_ours(keras.optimizers.SGD(0.01)), nan_batches=[1],
                          callbacks=[LogScale()])
    optimizer = model.optimizer
    assert history.history["scale"] == [float(optimizer.loss_scale)] == [
        float(optimizer.loss_scale())] == [2.0**9]
    for name in ("model.keras", "model.h5"):
        path = os.path.join(_TMP, f"isinstance_{name}")
        model.save(path)
        loaded = keras.models.load_model(path).optimizer
        assert isinstance(loaded, tf_lossscale.LossScaleOptimizer), name
        assert isinstance(loaded, keras.mixed_precision.LossScaleOptimizer)
        assert float(loaded.loss_scale) == 2.0**9, name
    try:
        tf_lossscale.LossScaleOptimizer(1)
    except TypeError as error:
        assert "`tf.keras.optimizers.Optimizer`" in str(error), error
    else:
        raise AssertionError("a non-optimizer was wrapped")


@journey
def checkpoints_of_tf_keras_own_wrapper_restore_into_ours_and_back():
    theirs_model, _ = _fit(keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=2.0**12,
        dynamic_growth_steps=1000), nan_batches=[1])
    theirs = theirs_model.optimizer
    path = tf.train.Checkpoint(optimizer=theirs, model=theirs_model).save(
        os.path.join(_TMP, "theirs"))
    model = _model()
    ours = _ours(keras.optimizers.Adam(0.01), initial=1.0)
    ours.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=ours, model=model).restore(
        path).expect_partial()
    assert float(ours.loss_scale()) == float(theirs.loss_scale) == 2.0**11
    assert int(ours.dynamic_counter) == int(theirs.dynamic_counter)
    _close(_optimizer_values(ours), _optimizer_values(theirs), 0, 0)

    path = tf.train.Checkpoint(optimizer=ours, model=model).save(
        os.path.join(_TMP, "ours"))
    back = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())
    back.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=back, model=_model()).restore(
        path).expect_partial()
    assert float(back.loss_scale) == 2.0**11
    assert int(back.dynamic_counter) == int(ours.dynamic_counter)


@journey
def configs_written_by_tf_keras_wrapper_load():
    for inner in (keras.optimizers.Adam(), keras.optimizers.legacy.Adam()):
        theirs = keras.mixed_precision.LossScaleOptimizer(
            inner, dynamic=False, initial_scale=64.0)
        ours = tf_lossscale.LossScaleOptimizer.from_config(theirs.get_config())
        assert isinstance(ours, keras.mixed_precision.LossScaleOptimizer)
        assert isinstance(ours.loss_scale, tf_lossscale.FixedLossScale)
        assert float(ours.loss_scale()) == 64.0
        assert type(ours.inner_optimizer) is type(inner)
        config = keras.optimizers.serialize(ours)
        again = keras.optimizers.deserialize(config)
        assert again.get_config() == ours.get_config()


def _record_nonfinite_gradients(optimizer, count):
    """Makes `optimizer.apply_gradients` keep which of the `count` gradients
    it was handed were non-finite, at the last step that had any; returns
    that record (a bool variable)."""
    record = tf.Variable(tf.zeros([count], tf.bool), trainable=False)
    apply = optimizer.apply_gradients

    def recording_apply(grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        nonfinite = tf.stack([tf.logical_not(tf.reduce_all(
            tf.math.is_finite(grad))) for grad, _ in grads_and_vars])
        record.assign(tf.where(tf.reduce_any(nonfinite), nonfinite, record))
        return apply(grads_and_vars, *args, **kwargs)

    optimizer.apply_gradients = recording_apply
    return record


@journey
def fixed_scale_that_skips_non_finite_steps():
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        loss_scale=tf_lossscale.FixedLossScale(1, skip_non_finite=True))
    # Which gradients a NaN input reaches depends on the kernels that ran:
    # relu(NaN) is NaN in TensorFlow's eager Relu but 0 in some fused
    # matmul-bias-relu kernels of a compiled step (oneDNN's, on by default on
    # some CPUs). So the expected names are those of the gradients the fit
    # step itself handed the wrapper, not recomputed another way.
    handed_nonfinite = _record_nonfinite_gradients(optimizer, 4)
    model, _ = _fit(optimizer, nan_batches=[0, 3])
    assert (int(optimizer.skipped_steps), int(optimizer.iterations)) == (2, 4)
    assert float(optimizer.loss_scale()) == 1.0
    assert all(np.isfinite(w).all() for w in model.get_weights())
    expected = [variable.name.split(":")[0] for variable, nonfinite
                in zip(model.trainable_variables, handed_nonfinite.numpy())
                if nonfinite]
    # NaN times anything is NaN: the first kernel's gradient always is.
    assert model.trainable_variables[0].name.split(":")[0] in expected, (
        expected)
    assert optimizer.last_nonfinite_variables() == expected


@journey
def xla_fit_needs_a_watcher_for_the_failure_policy():
    # jit_compile=True, as on a GPU: without a watcher the step fails before
    # it runs, naming the fix; with XlaChecks it raises at the floor.
    loss_scale = tf_lossscale.DynamicLossScale(1.0, on_min_loss_scale="raise")
    model = _model()
    optimizer = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(0.01),
                                                loss_scale=loss_scale)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    x, y = training.summed_data(8, 6)
    weights = model.get_weights()
    try:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    except RuntimeError as error:
        assert "tf_lossscale.XlaChecks()" in str(error), error
    else:
        raise AssertionError("an unwatched XLA step ran")
    for now, before in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(now, before)
    checks = tf_lossscale.XlaChecks()
    assert isinstance(checks, keras.callbacks.Callback)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
              callbacks=[checks])
    weights = model.get_weights()
    x, y = training.summed_data(8, 2, nan_batches=[0], nan_row=-1)
    try:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[checks])
    except tf.errors.InvalidArgumentError as error:
        assert "min_loss_scale=1.0" in str(error), error
    else:
        raise AssertionError("no error at the floor under XLA")
    for now, before in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(now, before)
    assert int(optimizer.iterations) == 6


@journey
def loss_scale_state_from_a_file_is_checked_field_by_field():
    # set_weights (what .h5 and .keras files go through): a counter an int64
    # cannot hold exactly is refused before anything is assigned, naming it;
    # an out-of-range counter loads and the first step refuses it.
    loss_scale = tf_lossscale.DynamicLossScale(8.0, 5, hysteresis=3,
                                               max_consecutive_skips=4)
    model, _ = _fit(tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), loss_scale=loss_scale), batches=1)
    optimizer = model.optimizer
    weights = optimizer.get_weights()
    first = len(weights) - len(loss_scale.variables) - 2  # Then the wrapper's.
    for index, value, field in [(1, 1.5, "good_steps"),
                                (1, np.nan, "good_steps"),
                                (3, 1e30, "consecutive_skips"),
                                (2, np.zeros(3), "hysteresis_remaining")]:
        crafted = list(weights)
        crafted[first + index] = np.asarray(value)
        try:
            optimizer.set_weights(crafted)
        except ValueError as error:
            assert f"loss scale's {field} in this file" in str(error), error
        else:
            raise AssertionError(f"{field}={value!r} was loaded")
        for now, before in zip(optimizer.get_weights(), weights):
            np.testing.assert_array_equal(now, before)
    loss_scale.variables[2].assign(-1)
    path = os.path.join(_TMP, "bad_budget.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.loss_scale.variables[2].numpy()) == -1
    try:
        loaded.fit(*training.summed_data(8), batch_size=8, verbose=0)
    except tf.errors.InvalidArgumentError as error:
        assert "hysteresis_remaining" in str(error), error
        assert "-1" in str(error), error
    else:
        raise AssertionError("hysteresis_remaining=-1 trained on")
    assert int(loaded.optimizer.iterations) == 1


@journey
def loss_scale_monitor_logs_to_history_csv_and_tensorboard():
    monitor = tf_lossscale.LossScaleMonitor(verbose=True)
    assert isinstance(monitor, keras.callbacks.Callback)
    csv_path = os.path.join(_TMP, "log.csv")
    logdir = os.path.join(_TMP, "tb")
    model, history = _fit(
        _ours(keras.optimizers.SGD(0.01)), nan_batches=[1],
        callbacks=[monitor, keras.callbacks.CSVLogger(csv_path),
                   keras.callbacks.TensorBoard(logdir, write_graph=False)])
    assert history.history["loss_scale"] == [2.0**9]
    assert history.history["skipped_steps"] == [1]
    rows = list(csv.DictReader(open(csv_path)))
    assert (float(rows[0]["loss_scale"]), int(rows[0]["skipped_steps"])) == (
        2.0**9, 1)
    tags = {}
    for path in tf.io.gfile.glob(f"{logdir}/train/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags[value.tag] = float(tf.make_ndarray(value.tensor))
    assert tags["epoch_loss_scale"] == 2.0**9, tags
    assert tags["epoch_skipped_steps"] == 1.0
    del model


# A GAN's two optimizers on one loss scale: tests/keras/
# test_several_optimizers.py's journey, with tf-keras.
_GAN_STEPS, _GAN_BATCH, _GAN_POISONED = 16, 8, 9
_GAN_INITIAL, _GAN_PERIOD = 2.0**12, 4


@functools.cache
def _gan_weights():
    return gan.initial_weights(keras)


def _gan_run(policy, loss_scale, make_inner, jit_compile=False,
             strategy=None):
    keras.mixed_precision.set_global_policy(policy)
    try:
        with strategy.scope() if strategy else contextlib.nullcontext():
            group = tf_lossscale.LossScaleGroup(loss_scale())
            optimizers = [tf_lossscale.LossScaleOptimizer(
                make_inner(), loss_scale=group) for _ in range(2)]
            monitor = tf_lossscale.LossScaleMonitor(
                optimizers={"d": optimizers[0], "g": optimizers[1]})
            return gan.fit(
                keras, gan.build(keras, _gan_weights()), optimizers,
                gan.data(_GAN_STEPS, _GAN_BATCH,
                         poison_batches=[_GAN_POISONED]),
                _GAN_BATCH, jit_compile=jit_compile, callbacks=[monitor],
                snapshots=(_GAN_POISONED - 1, _GAN_POISONED))
    finally:
        keras.mixed_precision.set_global_policy("float32")


@functools.cache
def _gan_float32_run():
    return _gan_run("float32", lambda: tf_lossscale.FixedLossScale(
        1, skip_non_finite=True), lambda: gan.inner_optimizer(keras))


def _gan_journey(make_inner, **kwargs):
    mixed = _gan_run("mixed_float16", lambda: tf_lossscale.DynamicLossScale(
        _GAN_INITIAL, _GAN_PERIOD), make_inner, **kwargs)
    for step, (ours, theirs) in enumerate(zip(mixed, _gan_float32_run())):
        for key in ("d_loss", "g_loss"):
            assert abs(ours[key] - theirs[key]) < 0.01, (step, key)
    before = mixed[_GAN_POISONED - 1]["values"]
    after = mixed[_GAN_POISONED]["values"]
    for key in ("g", "g_inner"):
        for now, was in zip(after[key], before[key]):
            np.testing.assert_array_equal(now, was, err_msg=key)
    assert not np.array_equal(after["d"][0], before["d"][0])
    assert [step["skipped"] for step in mixed] == (
        [[0, 0]] * _GAN_POISONED + [[0, 1]] * (_GAN_STEPS - _GAN_POISONED))
    scales = [step["scale"] for step in mixed]
    expected = reference_oracle.reference_scales(
        [step != _GAN_POISONED for step in range(_GAN_STEPS)],
        _GAN_INITIAL, _GAN_PERIOD, 2.0)
    assert scales == expected, (scales, expected)
    for step in mixed:
        assert step["logs"] == {"loss_scale": step["scale"],
                                "d_skipped_steps": step["skipped"][0],
                                "g_skipped_steps": step["skipped"][1]}


@journey
def gan_with_a_loss_scale_group_skips_one_optimizer_and_tracks_float32():
    _gan_journey(lambda: gan.inner_optimizer(keras))


@journey
def gan_with_a_loss_scale_group_under_xla():
    _gan_journey(lambda: gan.inner_optimizer(keras), jit_compile=True)


@journey
def gan_with_a_loss_scale_group_of_legacy_optimizers_under_mirrored():
    # The NaN is the last example of its batch: replica 1's part.
    _gan_journey(lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.5),
                 strategy=training.mirrored(2))


def names():
    return sorted(JOURNEYS)


def run(name):
    """Runs the journey `name`; it raises if it fails."""
    JOURNEYS[name]()

"""`tf_lossscale.LossScaleOptimizer` with tf-keras (Keras 2) optimizers.

In-process, with `tf_keras` imported directly (this process imported Keras 3
first, so `tf.keras` is Keras 3 here): the dispatch to the tf-keras wrapper,
the TF 2.x custom loop and `minimize`, skipping under MirroredStrategy with a
NaN on one replica, rule arguments (traces compared with the Keras 3 wrapper's
in the same run), configs and checkpoints of tf-keras' own wrapper. The user
journeys with `TF_USE_LEGACY_KERAS=1` (compile, fit, saving, callbacks) run in
subprocesses: `test_tf_keras_journeys.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures import make_fixtures
from tests.helpers import reference_oracle as oracle
from tests.helpers import training
from tests.helpers.training import values_of
import tf_lossscale
from tf_lossscale.tf_keras import loss_scale_optimizer as tf_keras_optimizer

pytestmark = pytest.mark.usefixtures("keras_isolation")

_KINDS = {
    "optimizer": lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
    "legacy": lambda: tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9),
}
_NAN = float("nan")


def _model(seed=0):
    tf_keras.utils.set_random_seed(seed)
    return tf_keras.Sequential([tf_keras.Input((3,)),
                                tf_keras.layers.Dense(2, name="hidden"),
                                tf_keras.layers.Dense(1, name="out")])


def _optimizer_variables(optimizer):
    variables = optimizer.variables
    return variables() if callable(variables) else variables


def _plain_step(model, optimizer, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def _tf2_step(model, optimizer, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
        scaled = optimizer.get_scaled_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    grads = optimizer.get_unscaled_gradients(grads)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_wraps_tf_keras_optimizers_as_tf_keras_loss_scale_optimizer(kind):
    optimizer = tf_lossscale.LossScaleOptimizer(_KINDS[kind](), loss_scale=8)
    assert isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer)
    assert isinstance(optimizer, (tf_keras.optimizers.Optimizer,
                                  tf_keras.optimizers.legacy.Optimizer))
    assert not isinstance(optimizer, keras.optimizers.Optimizer)
    assert float(optimizer.loss_scale()) == 8.0
    assert optimizer.dynamic is False
    expected = (tf_keras_optimizer.LegacyLossScaleOptimizer if kind == "legacy"
                else tf_keras_optimizer.LossScaleOptimizer)
    assert type(optimizer) is expected


def test_keras3_optimizers_still_get_the_keras3_wrapper():
    optimizer = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD())
    assert type(optimizer) is tf_lossscale.LossScaleOptimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_refuses_what_tf_keras_refuses_with_its_exception_types(kind):
    # tf-keras users' code matches these types and phrases.
    theirs = tf_keras.mixed_precision.LossScaleOptimizer(_KINDS[kind]())
    ours = tf_lossscale.LossScaleOptimizer(_KINDS[kind]())
    for wrapper in (theirs, ours):
        with pytest.raises(TypeError, match="LossScaleOptimizer cannot wrap "
                           "another LossScaleOptimizer, but got: <"):
            tf_lossscale.LossScaleOptimizer(wrapper)
    inner = _KINDS[kind]()
    first = tf_lossscale.LossScaleOptimizer(inner)
    already = ('"inner_optimizer" is already wrapped by a LossScaleOptimizer. '
               "An optimizer can only be wrapped by a single")
    with pytest.raises(ValueError, match=already):
        tf_lossscale.LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match=already):
        tf_keras.mixed_precision.LossScaleOptimizer(inner)
    del first
    with pytest.raises(TypeError, match='"dynamic" argument to '
                       r"LossScaleOptimizer.__init__ must be a bool, but got: "
                       "'dynamic'"):
        tf_lossscale.LossScaleOptimizer(_KINDS[kind](), dynamic="dynamic")
    with pytest.raises(ValueError, match='"initial_scale" must be specified '
                       'if "dynamic" is False'):
        tf_lossscale.LossScaleOptimizer(_KINDS[kind](), dynamic=False)
    with pytest.raises(ValueError, match='"dynamic_growth_steps" must be None '
                       'if "dynamic" is False, but got: 2'):
        tf_lossscale.LossScaleOptimizer(_KINDS[kind](), dynamic=False,
                                        initial_scale=1,
                                        dynamic_growth_steps=2)


def test_a_non_optimizer_among_tf_keras_objects_is_refused_naming_tf_keras():
    with pytest.raises(TypeError, match='"inner_optimizer" must be an '
                       "instance of `tf.keras.optimizers.Optimizer` or "
                       "`tf.keras.optimizers.experimental.Optimizer`, but "
                       "got: <tf_keras"):
        tf_lossscale.LossScaleOptimizer(tf_keras.layers.Dense(1))


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_unsupported_strategy_is_refused_in_tf_keras_words(kind):
    expected = ("Loss scaling is not supported with the tf.distribute."
                "Strategy: CentralStorageStrategy. Try using a different "
                "Strategy, e.g. a MirroredStrategy")
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    with strategy.scope(), pytest.raises(ValueError, match=expected):
        tf_lossscale.LossScaleOptimizer(_KINDS[kind]())
    optimizer = tf_lossscale.LossScaleOptimizer(_KINDS[kind](),
                                                loss_scale=2)
    with strategy.scope():
        variable = tf.Variable(1.0)
        values = values_of([variable])
        with pytest.raises(ValueError, match=expected):
            strategy.run(lambda: optimizer.minimize(lambda: variable * 2.0,
                                                    [variable]))
    np.testing.assert_equal(values_of([variable]), values)


@pytest.mark.parametrize("kind", sorted(_KINDS))
@pytest.mark.parametrize("loop", ["eager", "function", "minimize"])
def test_non_finite_step_is_skipped_and_finite_steps_match_plain_optimizer(
        kind, loop):
    model, reference = _model(), _model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        _KINDS[kind](), loss_scale=tf_lossscale.DynamicLossScale(4.0, 2))
    plain = _KINDS[kind]()

    def loss_fn(x, y):
        return lambda: tf.reduce_mean(tf.square(model(x) - y))

    step = _tf2_step if loop != "minimize" else (
        lambda m, o, x, y: o.minimize(loss_fn(x, y), m.trainable_variables))
    if loop == "function":
        step = tf.function(step)
    nan_steps = {1, 3}
    for index in range(5):
        x, y = make_fixtures.batch(index, finite=index not in nan_steps)
        inner_before = values_of(
            _optimizer_variables(optimizer.inner_optimizer))
        step(model, optimizer, x, y)
        if index in nan_steps:
            # Weights, slots and iterations exactly as they were.
            np.testing.assert_equal(
                values_of(_optimizer_variables(optimizer.inner_optimizer)),
                inner_before)
        else:
            _plain_step(reference, plain, x, y)
        for ours, theirs in zip(model.weights, reference.weights):
            np.testing.assert_allclose(ours.numpy(), theirs.numpy(),
                                       rtol=1e-6, atol=1e-7)
    assert int(optimizer.iterations) == 3
    assert int(optimizer.skipped_steps) == 2
    assert float(optimizer.loss_scale()) == oracle.reference_scales(
        [index not in nan_steps for index in range(5)], 4.0, 2, 2.0)[-1]
    assert optimizer.last_nonfinite_variables() == [
        "hidden/kernel", "hidden/bias", "out/kernel", "out/bias"]


def test_records_only_the_variables_whose_gradients_overflowed():
    variables = [tf.Variable([1.0, 2.0], name="finite"),
                 tf.Variable([3.0], name="overflowing")]
    optimizer = tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.SGD(0.1), loss_scale=2)
    optimizer.apply_gradients(zip(
        [tf.constant([1.0, 1.0]), tf.constant([np.inf])], variables))
    assert optimizer.last_nonfinite_variables() == []  # fixed: applied
    skipping = tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.SGD(0.1),
        loss_scale=tf_lossscale.FixedLossScale(2, skip_non_finite=True))
    values = values_of(variables)
    skipping.apply_gradients(zip(
        [tf.constant([1.0, 1.0]), tf.constant([np.inf])], variables))
    np.testing.assert_equal(values_of(variables), values)
    assert skipping.last_nonfinite_variables() == ["overflowing"]
    assert float(skipping.loss_scale()) == 2.0
    assert int(skipping.skipped_steps) == 1


_RULE = dict(initial_loss_scale=8.0, increment_period=2, multiplier=3.0,
             backoff_factor=0.25, min_loss_scale=0.5, max_loss_scale=200.0,
             hysteresis=2)


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_every_rule_argument_gives_the_keras3_wrapper_trace(kind):
    pattern = [1.0, _NAN, _NAN, 1.0, 1.0, 1.0, 1.0, _NAN, 1.0, 1.0, 1.0]
    traces = []
    for make_inner in (_KINDS[kind], lambda: keras.optimizers.SGD(0.1)):
        optimizer = tf_lossscale.LossScaleOptimizer(
            make_inner(), loss_scale=tf_lossscale.DynamicLossScale(**_RULE))
        variable = tf.Variable([1.0])
        trace = []
        for grad in pattern:
            optimizer.apply_gradients([(tf.constant([grad]), variable)])
            trace.append((float(optimizer.loss_scale()),
                          int(optimizer.skipped_steps),
                          int(optimizer.iterations)))
        traces.append(trace)
    assert traces[0] == traces[1]
    assert len({scale for scale, _, _ in traces[0]}) > 2


def test_keras_style_arguments_and_tf_keras_configs_load():
    fixed = tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.SGD(), dynamic=False, initial_scale=64)
    assert isinstance(fixed.loss_scale, tf_lossscale.FixedLossScale)
    assert (fixed.initial_scale, fixed.dynamic_growth_steps) == (64.0, None)
    dynamic = tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.legacy.Adam(), initial_scale=16,
        dynamic_growth_steps=5)
    assert dynamic.dynamic and dynamic.dynamic_growth_steps == 5
    for make_inner in _KINDS.values():
        for theirs_kwargs in ({}, {"dynamic": False, "initial_scale": 32.0},
                              {"initial_scale": 4.0,
                               "dynamic_growth_steps": 7}):
            theirs = tf_keras.mixed_precision.LossScaleOptimizer(
                make_inner(), **theirs_kwargs)
            config = theirs.get_config()
            assert set(config) == {"inner_optimizer", "dynamic",
                                   "initial_scale", "dynamic_growth_steps"}
            ours = tf_keras_optimizer.LossScaleOptimizer.from_config(config)
            assert type(ours.inner_optimizer) is type(theirs.inner_optimizer)
            assert ours.dynamic == theirs.dynamic
            assert float(ours.loss_scale()) == float(theirs.loss_scale)
            assert ours.dynamic_growth_steps == theirs.dynamic_growth_steps
            again = tf_keras_optimizer.LossScaleOptimizer.from_config(
                ours.get_config())
            assert again.get_config() == ours.get_config()


def _train(optimizer, model, steps):
    for index in range(steps):
        _tf2_step(model, optimizer,
                  *make_fixtures.batch(index, finite=index != 1))


@pytest.mark.parametrize("kind", sorted(_KINDS))
@pytest.mark.parametrize("direction", ["theirs_to_ours", "ours_to_theirs"])
def test_checkpoints_of_tf_keras_wrapper_restore_both_ways(
        kind, direction, tmp_path):
    def make(which):
        inner = _KINDS[kind]()
        if which == "ours":
            return tf_lossscale.LossScaleOptimizer(
                inner, loss_scale=tf_lossscale.DynamicLossScale(64.0, 3))
        return tf_keras.mixed_precision.LossScaleOptimizer(
            inner, initial_scale=64.0, dynamic_growth_steps=3)

    source_name, target_name = direction.split("_to_")
    model, source = _model(), make(source_name)
    _train(source, model, 4)
    path = tf.train.Checkpoint(model=model, optimizer=source).save(
        str(tmp_path / "ckpt"))

    restored_model, target = _model(seed=1), make(target_name)
    target_inner = target.inner_optimizer
    if kind == "legacy":
        target_inner._create_all_weights(restored_model.trainable_variables)
    else:
        target_inner.build(restored_model.trainable_variables)
    tf.train.Checkpoint(model=restored_model, optimizer=target).restore(
        path).expect_partial()

    def scale_and_counter(optimizer):
        scale = optimizer.loss_scale
        scale = scale() if callable(scale) else scale
        return float(scale), int(optimizer.dynamic_counter)

    assert scale_and_counter(target) == scale_and_counter(source)
    assert scale_and_counter(source) != (64.0, 0)
    np.testing.assert_equal(values_of(restored_model.weights),
                            values_of(model.weights))
    np.testing.assert_equal(
        values_of(_optimizer_variables(target_inner)),
        values_of(_optimizer_variables(source.inner_optimizer)))


def test_nan_on_one_replica_is_skipped_on_every_replica():
    strategy = training.mirrored(4)
    with strategy.scope():
        model = _model()
        optimizer = tf_lossscale.LossScaleOptimizer(
            tf_keras.optimizers.SGD(0.1, momentum=0.9),
            loss_scale=tf_lossscale.DynamicLossScale(4.0, 2))
    reference, plain = _model(), tf_keras.optimizers.SGD(0.1, momentum=0.9)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                tf.reduce_mean(tf.square(model(x) - y), axis=-1),
                global_batch_size=8)
            scaled = optimizer.get_scaled_loss(loss)
        grads = optimizer.get_unscaled_gradients(
            tape.gradient(scaled, model.trainable_variables))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(x, y):
        strategy.run(replica_step, args=(x, y))

    rng = np.random.default_rng(3)
    for step in range(3):
        x = rng.normal(size=(8, 3)).astype(np.float32)
        y = rng.normal(size=(8, 1)).astype(np.float32)
        if step == 1:
            x[7, 0] = np.nan  # The last of four replicas only.
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
        train_step(*next(iter(dataset)))
        if step != 1:
            _plain_step(reference, plain, x, y)
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations.numpy()) == 2
    assert float(optimizer.loss_scale()) == 2.0
    for ours, theirs in zip(model.weights, reference.weights):
        for replica_value in strategy.experimental_local_results(ours):
            np.testing.assert_allclose(replica_value.numpy(), theirs.numpy(),
                                       rtol=1e-5, atol=1e-6)


def test_monitor_for_tf_keras_logs_scale_and_skips_in_tf_keras_fit(capsys):
    monitor = tf_lossscale.LossScaleMonitor.for_tf_keras(verbose=True)
    assert isinstance(monitor, tf_keras.callbacks.Callback)
    assert isinstance(tf_lossscale.LossScaleMonitor(), keras.callbacks.Callback)
    model = _model()
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.SGD(0.01),
        loss_scale=tf_lossscale.DynamicLossScale(64.0, 1000)), loss="mse")
    x, y = zip(*(make_fixtures.batch(step, finite=step != 1)
                 for step in range(3)))
    history = model.fit(np.concatenate(x), np.concatenate(y), batch_size=8,
                        shuffle=False, verbose=0, callbacks=[monitor])
    assert history.history["loss_scale"] == [32.0]
    assert history.history["skipped_steps"] == [1]
    printed = capsys.readouterr().out
    assert "skipped step 2; loss scale 64.0 -> 32.0" in printed
    assert "non-finite gradients: hidden/kernel, " in printed


def test_monitor_refuses_tf_keras_own_wrapper():
    model = _model()
    model.compile(optimizer=tf_keras.mixed_precision.LossScaleOptimizer(
        tf_keras.optimizers.SGD()), loss="mse")
    x, y = make_fixtures.batch(0)
    with pytest.raises(TypeError, match="wrapping SGD"):
        model.fit(x, y, verbose=0, callbacks=[
            tf_lossscale.LossScaleMonitor.for_tf_keras()])

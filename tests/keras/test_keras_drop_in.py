"""tf_lossscale's wrapper as a drop-in for Keras' and tf-keras' wrappers.

What code written for `keras.mixed_precision.LossScaleOptimizer` (Keras 3) or
tf-keras' version reads, sets and saves must work the same way here: its
attributes, its configs, its hyperparameters, its checkpoints (also across
wrapping and unwrapping), and loud failures where those wrappers would
silently train wrong.
"""

import functools
import json
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures import make_fixtures
from tests.helpers import training
from tests.helpers.models import tiny_model
from tests.helpers.training import values_of
from tf_lossscale import LossScaleOptimizer

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _assert_all_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


# ---------------------------------------------------------------------------
# Attributes.


def test_dynamic_tells_a_dynamic_scale_from_a_fixed_one():
    assert LossScaleOptimizer(keras.optimizers.SGD()).dynamic is True
    assert LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=8).dynamic is False
    assert LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=8).dynamic is (
        False)


def test_dynamic_counter_counts_good_steps_and_resets_on_a_skip():
    model = tiny_model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.01),
                                   dynamic_growth_steps=10)
    model.compile(optimizer=optimizer, loss="mse")

    counts = []
    for step, finite in enumerate([True, True, True, False, True]):
        model.train_on_batch(*make_fixtures.batch(step, finite))
        counts.append(int(optimizer.dynamic_counter))

    assert counts == [1, 2, 3, 0, 1]


def test_dynamic_counter_is_none_for_a_fixed_scale():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=8)

    assert optimizer.dynamic_counter is None


def test_variables_list_the_loss_scale_state_like_keras_does():
    model = tiny_model()
    ours = LossScaleOptimizer(keras.optimizers.Adam())
    keras_own = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.Adam())
    ours.build(model.trainable_variables)
    keras_own.build(model.trainable_variables)

    listed = {id(v) for v in ours.variables}
    keras_names = {v.name for v in keras_own.variables}

    assert {id(v) for v in ours.loss_scale.variables} <= listed
    assert {id(v) for v in ours.inner_optimizer.variables} <= listed
    # Keras lists its scale and counter beside the inner optimizer's state.
    assert {"dynamic_scale", "step_counter"} <= keras_names
    assert len(ours.variables) == len(listed)


def test_variables_hold_the_current_scale_after_training():
    model = tiny_model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=optimizer, loss="mse")
    model.train_on_batch(*make_fixtures.batch(0, finite=False))

    values = {v.name.split(":")[0]: float(v.numpy())
              for v in optimizer.variables if v.shape.rank == 0}

    assert values["current_loss_scale"] == 2.0**14
    assert values["good_steps"] == 0


# ---------------------------------------------------------------------------
# Errors name what the user typed.


@pytest.mark.parametrize("kwargs, name", [
    ({"initial_scale": -1}, "initial_scale"),
    ({"initial_scale": float("nan")}, "initial_scale"),
    ({"dynamic_growth_steps": 0}, "dynamic_growth_steps"),
    ({"dynamic_growth_steps": 2.5}, "dynamic_growth_steps"),
    ({"dynamic": False, "initial_scale": 0.5}, "initial_scale"),
])
def test_keras_style_argument_errors_name_the_keras_argument(kwargs, name):
    with pytest.raises((TypeError, ValueError)) as error:
        LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)

    message = str(error.value)
    value = [v for k, v in kwargs.items() if k == name][0]
    assert name in message
    assert repr(value) in message
    assert "initial_loss_scale" not in message
    assert "increment_period" not in message


def test_keras_style_argument_of_wrong_type_names_the_keras_argument():
    with pytest.raises(TypeError, match="dynamic_growth_steps.*'10'"):
        LossScaleOptimizer(keras.optimizers.SGD(), dynamic_growth_steps="10")


# ---------------------------------------------------------------------------
# Configs that other wrappers wrote.


def test_keras_config_with_integral_float_growth_steps_loads():
    config = keras.optimizers.serialize(
        keras.mixed_precision.LossScaleOptimizer(
            keras.optimizers.SGD(), dynamic_growth_steps=2))
    # What JSON round trips through other tools can turn ints into.
    config = json.loads(json.dumps(config).replace(
        '"dynamic_growth_steps": 2', '"dynamic_growth_steps": 2.0'))
    assert config["config"]["dynamic_growth_steps"] == 2.0

    optimizer = LossScaleOptimizer.from_config(config["config"])

    assert optimizer.dynamic_growth_steps == 2
    assert isinstance(optimizer.dynamic_growth_steps, int)


def test_tf_lossscale_config_with_integral_float_period_loads():
    config = LossScaleOptimizer(keras.optimizers.SGD()).get_config()
    config["loss_scale"]["config"]["increment_period"] = 2.0

    optimizer = LossScaleOptimizer.from_config(config)

    assert optimizer.loss_scale.increment_period == 2


@pytest.mark.parametrize("steps", [2.5, float("nan"), True])
def test_config_with_non_integral_growth_steps_is_rejected(steps):
    config = {"name": "lso", "inner_optimizer": keras.optimizers.serialize(
        keras.optimizers.SGD()), "initial_scale": 8.0,
              "dynamic_growth_steps": steps}

    with pytest.raises((TypeError, ValueError), match="dynamic_growth_steps"):
        LossScaleOptimizer.from_config(config)


# ---------------------------------------------------------------------------
# Inner-optimizer hyperparameters set on the wrapper.


def _trained_weights(optimizer, steps=3):
    model = tiny_model()
    model.compile(optimizer=optimizer, loss="mse")
    for step in range(steps):
        model.train_on_batch(*(v * 100 for v in make_fixtures.batch(step)))
    return values_of(model.weights)


@functools.cache
def _trained_weights_without_hyperparameters():
    # The same run for every case below: once per module.
    return _trained_weights(LossScaleOptimizer(keras.optimizers.SGD(0.1)))


@pytest.mark.parametrize("name, value", [
    ("clipnorm", 0.01),
    ("clipvalue", 0.001),
    ("global_clipnorm", 0.01),
    ("weight_decay", 0.5),
])
def test_hyperparameter_set_on_wrapper_trains_as_if_set_on_inner(name, value):
    wrapped = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    setattr(wrapped, name, value)

    assert getattr(wrapped, name) == value
    assert getattr(wrapped.inner_optimizer, name) == value
    trained = _trained_weights(wrapped)
    _assert_all_equal(trained, _trained_weights(LossScaleOptimizer(
        keras.optimizers.SGD(0.1, **{name: value}))))
    assert not np.array_equal(trained[0],
                              _trained_weights_without_hyperparameters()[0])


def test_ema_momentum_set_on_wrapper_reaches_the_inner_optimizer():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(use_ema=True))

    optimizer.ema_momentum = 0.5

    assert optimizer.inner_optimizer.ema_momentum == 0.5


@pytest.mark.parametrize("name, value", [
    ("use_ema", True),
    ("gradient_accumulation_steps", 2),
    ("loss_scale_factor", 128.0),
])
def test_build_time_hyperparameter_on_wrapper_is_refused(name, value):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())

    with pytest.raises(ValueError, match=rf"{name}=.*inner optimizer"):
        setattr(optimizer, name, value)
    assert not getattr(optimizer.inner_optimizer, name)


@pytest.mark.parametrize("name, value, error", [
    ("clipnorm", -1.0, ValueError),
    ("clipnorm", float("inf"), ValueError),
    ("clipvalue", "1", TypeError),
    ("weight_decay", True, TypeError),
    ("ema_momentum", 1.5, ValueError),
    ("ema_overwrite_frequency", 0, ValueError),
])
def test_bad_hyperparameter_on_wrapper_is_refused_untouched(name, value,
                                                             error):
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    before = getattr(optimizer.inner_optimizer, name)

    with pytest.raises(error, match=re.escape(name)):
        setattr(optimizer, name, value)
    assert getattr(optimizer.inner_optimizer, name) == before


def test_second_clipping_mode_on_wrapper_is_refused():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(global_clipnorm=1.0))

    with pytest.raises(ValueError, match="clipnorm=1.0.*global_clipnorm"):
        optimizer.clipnorm = 1.0
    assert optimizer.inner_optimizer.clipnorm is None


# ---------------------------------------------------------------------------
# Misuse of the TF 2.x protocol.


def _gradients_of_scaled_loss(model, optimizer):
    x, y = make_fixtures.batch(0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
        scaled = optimizer.get_scaled_loss(loss)
    return tape.gradient(scaled, model.trainable_variables)


@pytest.mark.parametrize("use_function", [False, True],
                         ids=["eager", "tf_function"])
def test_still_scaled_gradients_are_refused_and_nothing_changes(use_function):
    model = tiny_model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(model.trainable_variables)
    before = values_of(model.weights + optimizer.variables)

    def step():
        grads = _gradients_of_scaled_loss(model, optimizer)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    with pytest.raises(ValueError, match="get_unscaled_gradients"):
        (tf.function(step) if use_function else step)()
    _assert_all_equal(values_of(model.weights + optimizer.variables), before)


def test_unscaled_gradients_after_a_refused_step_are_applied():
    model = tiny_model()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    grads = _gradients_of_scaled_loss(model, optimizer)
    with pytest.raises(ValueError):
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    optimizer.apply_gradients(zip(optimizer.get_unscaled_gradients(grads),
                                  model.trainable_variables))

    assert int(optimizer.iterations) == 1


# ---------------------------------------------------------------------------
# Checkpoints across wrapping and unwrapping.


def _train_steps(model, steps, first=0):
    for step in range(first, first + steps):
        model.train_on_batch(*make_fixtures.batch(step))


def _compiled(optimizer, seed=0):
    model = tiny_model(seed)
    model.compile(optimizer=optimizer, loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def test_plain_checkpoint_resumes_under_the_wrapper(tmp_path):
    # Trained in float32 with a plain optimizer, then moved to float16.
    plain = _compiled(keras.optimizers.Adam(0.01))
    _train_steps(plain, 3)
    path = tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).write(
        str(tmp_path / "plain"))
    keras.mixed_precision.set_global_policy("mixed_float16")
    wrapped = _compiled(LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                           initial_scale=2.0**8), seed=1)

    tf.train.Checkpoint(model=wrapped, optimizer=wrapped.optimizer).read(
        path).expect_partial()

    _assert_all_equal(values_of(wrapped.weights), values_of(plain.weights))
    _assert_all_equal(values_of(wrapped.optimizer.inner_optimizer.variables),
                      values_of(plain.optimizer.variables))
    assert int(wrapped.optimizer.iterations) == 3
    assert float(wrapped.optimizer.loss_scale()) == 2.0**8
    _train_steps(wrapped, 1, first=3)
    assert int(wrapped.optimizer.iterations) == 4


def test_keras_wrapper_checkpoint_restores_inner_state(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    theirs = _compiled(keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=2.0**8,
        dynamic_growth_steps=2))
    _train_steps(theirs, 3)
    path = tf.train.Checkpoint(model=theirs, optimizer=theirs.optimizer).write(
        str(tmp_path / "keras"))
    ours = _compiled(LossScaleOptimizer(keras.optimizers.Adam(0.01),
                                        initial_scale=2.0**8,
                                        dynamic_growth_steps=2), seed=1)

    tf.train.Checkpoint(model=ours, optimizer=ours.optimizer).read(
        path).expect_partial()

    _assert_all_equal(values_of(ours.optimizer.inner_optimizer.variables),
                      values_of(theirs.optimizer.inner_optimizer.variables))
    assert int(ours.optimizer.iterations) == int(theirs.optimizer.iterations)
    assert float(ours.optimizer.loss_scale()) == 2.0**8


def test_wrapped_checkpoint_restores_into_a_plain_optimizer(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    wrapped = _compiled(LossScaleOptimizer(keras.optimizers.Adam(0.01)))
    _train_steps(wrapped, 3)
    wrapped.train_on_batch(*make_fixtures.batch(0, finite=False))
    path = tf.train.Checkpoint(model=wrapped,
                               optimizer=wrapped.optimizer).write(
                                   str(tmp_path / "wrapped"))
    keras.mixed_precision.set_global_policy("float32")
    plain = _compiled(keras.optimizers.Adam(0.01), seed=1)

    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(
        path).expect_partial().assert_existing_objects_matched()

    _assert_all_equal(values_of(plain.weights), values_of(wrapped.weights))
    _assert_all_equal(values_of(plain.optimizer.variables),
                      values_of(wrapped.optimizer.inner_optimizer.variables))
    assert int(plain.optimizer.iterations) == int(
        wrapped.optimizer.iterations) > 0
    assert float(plain.optimizer.learning_rate) == pytest.approx(0.01)


def test_wrapped_checkpoint_round_trips_loss_scale_and_inner_state(tmp_path):
    wrapped = _compiled(LossScaleOptimizer(keras.optimizers.Adam(0.01)))
    _train_steps(wrapped, 2)
    wrapped.train_on_batch(*make_fixtures.batch(0, finite=False))
    path = tf.train.Checkpoint(model=wrapped,
                               optimizer=wrapped.optimizer).write(
                                   str(tmp_path / "wrapped"))
    restored = _compiled(LossScaleOptimizer(keras.optimizers.Adam(0.01)),
                         seed=1)

    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(
        path).assert_consumed()

    def saved_state(optimizer):
        # All but which variables overflowed last: a diagnostic that
        # checkpoints leave out (see tf_lossscale.keras3.saving).
        return values_of(optimizer.inner_optimizer.variables
                       + list(optimizer.loss_scale.variables)
                       + [optimizer.skipped_steps])

    _assert_all_equal(saved_state(restored.optimizer),
                      saved_state(wrapped.optimizer))
    assert int(restored.optimizer.skipped_steps) == 1


# ---------------------------------------------------------------------------
# bfloat16.


def _caught_warnings(make):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught
            if "bfloat16" in str(w.message)]


def test_scaling_under_bfloat16_warns_once_with_the_alternative():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")

    messages = _caught_warnings(
        lambda: LossScaleOptimizer(keras.optimizers.SGD()))

    assert len(messages) == 1
    assert "FixedLossScale(1, skip_non_finite=True)" in messages[0]


@pytest.mark.parametrize("policy, loss_scale", [
    ("mixed_bfloat16", 1),
    ("mixed_float16", "dynamic"),
    ("float32", "dynamic"),
])
def test_no_bfloat16_warning_when_nothing_is_scaled_needlessly(policy,
                                                              loss_scale):
    keras.mixed_precision.set_global_policy(policy)

    assert not _caught_warnings(
        lambda: LossScaleOptimizer(keras.optimizers.SGD(),
                                   loss_scale=loss_scale))


# ---------------------------------------------------------------------------
# Mirrored state stays with its strategy.


def test_optimizer_created_under_a_strategy_refuses_to_step_outside_it():
    strategy = training.mirrored(2)
    with strategy.scope():
        model = tiny_model()
        optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
        optimizer.build(model.trainable_variables)
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    before = values_of(model.weights + optimizer.variables)

    with pytest.raises(ValueError, match="created under MirroredStrategy"):
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    _assert_all_equal(values_of(model.weights + optimizer.variables), before)

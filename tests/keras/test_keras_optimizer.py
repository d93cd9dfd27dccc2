"""`tf_lossscale.LossScaleOptimizer` on one device: API, errors, custom loops.

Expected scales come from TensorFlow's reference
`tf.compat.v1.mixed_precision` loss scales fed the same finite/non-finite
sequence. Expected weights come from the inner optimizer alone, applied to the
unscaled gradients of the finite steps: with power-of-two scales, scaling and
unscaling are exact, so the two must agree bit for bit.
"""

import functools
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
from tests.helpers import models
from tests.helpers import reference_oracle as oracle
from tests.helpers.training import values_of
import tf_lossscale
from tf_lossscale import LossScaleOptimizer

_NAN = float("nan")
_INF = float("inf")


pytestmark = pytest.mark.usefixtures("keras_isolation")


def _sgd():
    return keras.optimizers.SGD(learning_rate=0.1)


def _reference_step(model, optimizer, x, y):
    """A plain, unscaled step: what a finite scaled step must reproduce."""
    with tf.GradientTape() as tape:
        loss = _loss(model, x, y)
    optimizer.apply_gradients(zip(
        tape.gradient(loss, model.trainable_variables),
        model.trainable_variables))


def _loss(model, x, y):
    return tf.reduce_mean(tf.square(model(x) - y))


def _assert_all_equal(actual, expected):
    """Bit-for-bit equality of variables or arrays, pairwise."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(getattr(a, "numpy", lambda: a)(),
                                      getattr(e, "numpy", lambda: e)())


@pytest.mark.parametrize("identifier, expected", [
    (8, tf_lossscale.FixedLossScale(8)),
    (128.0, tf_lossscale.FixedLossScale(128.0)),
    ("dynamic", tf_lossscale.DynamicLossScale()),
    ({"class_name": "DynamicLossScale",
      "config": {"initial_loss_scale": 64.0, "increment_period": 5,
                 "multiplier": 3.0}},
     tf_lossscale.DynamicLossScale(64.0, 5, 3.0)),
    ({"class_name": "FixedLossScale", "config": {"loss_scale_value": 16.0}},
     tf_lossscale.FixedLossScale(16.0)),
], ids=["int", "float", "dynamic", "dynamic_dict", "fixed_dict"])
def test_loss_scale_argument_takes_what_get_takes(identifier, expected):
    optimizer = LossScaleOptimizer(_sgd(), loss_scale=identifier)

    assert type(optimizer.loss_scale) is type(expected)
    assert optimizer.loss_scale.get_config() == expected.get_config()
    assert float(optimizer.loss_scale()) == float(expected())


def test_loss_scale_instance_is_used_as_given():
    loss_scale = tf_lossscale.DynamicLossScale(4.0, 10, 1.5)

    optimizer = LossScaleOptimizer(_sgd(), loss_scale)

    assert optimizer.loss_scale is loss_scale


def test_default_loss_scale_is_a_default_dynamic_loss_scale():
    optimizer = LossScaleOptimizer(_sgd())

    assert isinstance(optimizer.loss_scale, tf_lossscale.DynamicLossScale)
    assert (optimizer.loss_scale.get_config()
            == tf_lossscale.DynamicLossScale().get_config())


@pytest.mark.parametrize("keras_style_args", [
    {},
    {"initial_scale": 64.0},
    {"dynamic_growth_steps": 7},
    {"initial_scale": 256.0, "dynamic_growth_steps": 3},
], ids=["defaults", "initial_scale", "growth_steps", "both"])
def test_keras_style_arguments_match_keras_loss_scale_optimizer(
        keras_style_args):
    keras_optimizer = keras.mixed_precision.LossScaleOptimizer(
        _sgd(), **keras_style_args)

    optimizer = LossScaleOptimizer(_sgd(), **keras_style_args)

    assert isinstance(optimizer.loss_scale, tf_lossscale.DynamicLossScale)
    assert optimizer.loss_scale.get_config() == {
        "initial_loss_scale": keras_optimizer.initial_scale,
        "increment_period": keras_optimizer.dynamic_growth_steps,
        "multiplier": 2.0,
    }
    assert optimizer.initial_scale == keras_optimizer.initial_scale
    assert (optimizer.dynamic_growth_steps
            == keras_optimizer.dynamic_growth_steps)


def test_loss_scale_is_callable_for_the_current_scale():
    optimizer = LossScaleOptimizer(
        _sgd(), tf_lossscale.DynamicLossScale(4.0, 1))
    model = models.tiny_model(hidden_units=2)
    x, y = training.normal_data(4)

    scale = optimizer.loss_scale()
    with tf.GradientTape() as tape:
        scaled_loss = optimizer.get_scaled_loss(_loss(model, x, y))
    grads = optimizer.get_unscaled_gradients(
        tape.gradient(scaled_loss, model.trainable_variables))
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

    assert isinstance(scale, tf.Tensor)
    assert scale.dtype == tf.float32 and scale.shape == ()
    assert float(scale) == 4.0
    # Period 1: one finite step doubles the scale.
    assert float(optimizer.loss_scale()) == 8.0


def test_inner_optimizer_learning_rate_and_iterations_are_the_inner_ones():
    inner = keras.optimizers.Adam(learning_rate=0.01)
    optimizer = LossScaleOptimizer(inner)

    optimizer.learning_rate = 0.25

    assert optimizer.inner_optimizer is inner
    assert float(inner.learning_rate) == 0.25
    assert float(optimizer.learning_rate) == 0.25
    assert optimizer.iterations is inner.iterations


def test_variables_are_listed_once():
    optimizer = LossScaleOptimizer(keras.optimizers.Adam())
    model = models.tiny_model(hidden_units=2)
    optimizer.build(model.trainable_variables)

    ids = [id(v) for v in optimizer.variables]

    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------------------
# Constructor errors.


@pytest.mark.parametrize("not_an_optimizer", [
    "sgd",
    keras.optimizers.SGD,
    tf_lossscale.FixedLossScale(2),
], ids=["string", "class", "loss_scale"])
def test_non_optimizer_is_rejected_with_type_error(not_an_optimizer):
    with pytest.raises(TypeError, match="inner_optimizer") as error:
        LossScaleOptimizer(not_an_optimizer)
    assert type(not_an_optimizer).__name__ in str(error.value)


@pytest.mark.parametrize("make_wrapper", [
    lambda: LossScaleOptimizer(_sgd()),
    lambda: keras.mixed_precision.LossScaleOptimizer(_sgd()),
], ids=["ours", "keras"])
def test_wrapping_a_loss_scale_optimizer_again_is_rejected(make_wrapper):
    with pytest.raises(ValueError,
                       match="inner_optimizer.*already a LossScaleOptimizer"):
        LossScaleOptimizer(make_wrapper())


def test_wrapping_the_same_inner_optimizer_twice_is_rejected():
    inner = keras.optimizers.SGD(name="shared_sgd")
    first = LossScaleOptimizer(inner)

    with pytest.raises(ValueError, match="'shared_sgd'.*already wrapped"):
        LossScaleOptimizer(inner)
    assert first.inner_optimizer is inner


@pytest.mark.parametrize("loss_scale, keras_style_args", [
    (4, {"initial_scale": 8.0}),
    (tf_lossscale.DynamicLossScale(), {"dynamic_growth_steps": 10}),
    ({"class_name": "FixedLossScale", "config": {"loss_scale_value": 2.0}},
     {"initial_scale": 2.0}),
], ids=["number", "loss_scale", "dict"])
def test_loss_scale_conflicting_with_keras_style_arguments_is_rejected(
        loss_scale, keras_style_args):
    (name, value), = keras_style_args.items()

    with pytest.raises(ValueError) as error:
        LossScaleOptimizer(_sgd(), loss_scale=loss_scale, **keras_style_args)
    message = str(error.value)
    assert f"loss_scale={loss_scale!r}" in message
    assert f"{name}={value!r}" in message


def test_none_loss_scale_is_rejected():
    with pytest.raises(ValueError, match="loss_scale cannot be None"):
        LossScaleOptimizer(_sgd(), loss_scale=None)


def test_gradient_options_belong_on_the_inner_optimizer():
    with pytest.raises(ValueError, match=re.escape("clipnorm=1.0")):
        LossScaleOptimizer(_sgd(), clipnorm=1.0)
    with pytest.raises(TypeError, match=re.escape("momentum=0.9")):
        LossScaleOptimizer(_sgd(), momentum=0.9)


def test_inner_optimizer_with_its_own_loss_scale_factor_is_rejected():
    inner = keras.optimizers.SGD(loss_scale_factor=128.0)

    with pytest.raises(ValueError, match="loss_scale_factor=128.0"):
        LossScaleOptimizer(inner)


# ---------------------------------------------------------------------------
# Custom training loops: the Keras 3 and the TF 2.x protocol.


def _gradients_to_apply(optimizer, protocol, model, compute_loss):
    """The gradients a step of `protocol` hands to `apply_gradients`.

    "keras": of `scale_loss(loss)`, left scaled. "tf2": of
    `get_scaled_loss(loss)`, then `get_unscaled_gradients`.
    """
    with tf.GradientTape() as tape:
        loss = compute_loss()
        if protocol == "keras":
            target = optimizer.scale_loss(loss)
        else:
            target = optimizer.get_scaled_loss(loss)
    grads = tape.gradient(target, model.trainable_variables)
    if protocol == "tf2":
        grads = optimizer.get_unscaled_gradients(grads)
    return grads


def _make_train_step(model, optimizer, protocol, use_function):
    """One training step; `grad_poison[i]` is added to gradient i."""

    def train_step(x, y, grad_poison):
        grads = _gradients_to_apply(
            optimizer, protocol, model, lambda: _loss(model, x, y))
        grads = [g + p for g, p in zip(grads, tf.unstack(grad_poison))]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    return tf.function(train_step) if use_function else train_step


# (NaN in the input, index of a poisoned gradient, value added to it). The
# non-finite steps cover a NaN loss, which poisons every gradient, and an
# infinity in one gradient only, which must be found past the others.
_FINITE = (False, None, 0.0)
_STEPS = [
    _FINITE,
    (True, None, 0.0),
    _FINITE,
    _FINITE,
    (False, -1, _INF),
    (False, 0, -_INF),
    _FINITE,
]


_INNER_OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(learning_rate=0.1,
                                                 momentum=0.9),
}


@functools.cache
def _inner_optimizer_alone(inner):
    """{step: the weights after it} for the finite steps of `_STEPS`, and
    the slots at the end, of the same model trained by the inner optimizer
    alone: the same for every protocol and way of running, so computed
    once for all of them."""
    model = models.tiny_model(hidden_units=2)
    optimizer = _INNER_OPTIMIZERS[inner]()
    weights = {}
    for step, step_kind in enumerate(_STEPS):
        if step_kind == _FINITE:
            _reference_step(model, optimizer,
                            *training.normal_data(4, seed=step))
            weights[step] = values_of(model.weights)
    return weights, values_of(optimizer.variables)


@pytest.mark.parametrize("protocol", ["keras", "tf2"])
@pytest.mark.parametrize("use_function", [False, True],
                         ids=["eager", "tf_function"])
@pytest.mark.parametrize("inner", _INNER_OPTIMIZERS)
def test_custom_loop_applies_finite_steps_and_skips_non_finite_ones(
        protocol, use_function, inner):
    loss_scale_config = {"initial_loss_scale": 2.0**10,
                         "increment_period": 2, "multiplier": 2.0}
    model = models.tiny_model(hidden_units=2)
    optimizer = LossScaleOptimizer(
        _INNER_OPTIMIZERS[inner](),
        tf_lossscale.DynamicLossScale(**loss_scale_config))
    train_step = _make_train_step(model, optimizer, protocol, use_function)
    reference_weights, reference_slots = _inner_optimizer_alone(inner)
    expected_scales = oracle.reference_scales(
        [step == _FINITE for step in _STEPS], **loss_scale_config)
    num_vars = len(model.trainable_variables)

    for step, step_kind in enumerate(_STEPS):
        nan_in_input, poisoned, value = step_kind
        x, y = training.normal_data(4, seed=step)
        if nan_in_input:
            x[0, 0] = _NAN
        poison = np.zeros(num_vars, np.float32)
        if poisoned is not None:
            poison[poisoned] = value
        weights_before = values_of(model.weights)
        slots_before = values_of(optimizer.inner_optimizer.variables)
        iterations_before = int(optimizer.iterations)
        skipped_before = int(optimizer.skipped_steps)

        train_step(tf.constant(x), tf.constant(y), tf.constant(poison))

        assert float(optimizer.loss_scale()) == expected_scales[step], step
        if step_kind == _FINITE:
            _assert_all_equal(model.weights, reference_weights[step])
            assert int(optimizer.iterations) == iterations_before + 1
            assert int(optimizer.skipped_steps) == skipped_before
        else:
            _assert_all_equal(model.weights, weights_before)
            _assert_all_equal(optimizer.inner_optimizer.variables,
                              slots_before)
            assert int(optimizer.iterations) == iterations_before
            assert int(optimizer.skipped_steps) == skipped_before + 1
    # The slots follow the inner optimizer's too, not just the weights.
    _assert_all_equal(optimizer.inner_optimizer.variables, reference_slots)


@pytest.mark.parametrize("protocol", ["keras", "tf2"])
def test_fixed_loss_scale_applies_non_finite_gradients(protocol):
    # TF's semantics: a fixed scale cannot recover from an overflow by
    # waiting, so it never asks to skip.
    _, reference_should_apply = tf.compat.v1.mixed_precision.FixedLossScale(
        8.0).update([tf.constant(_INF)])
    model = models.tiny_model(hidden_units=2)
    optimizer = LossScaleOptimizer(_sgd(), loss_scale=8)
    train_step = _make_train_step(model, optimizer, protocol,
                                  use_function=False)
    x, y = training.normal_data(4)
    poison = np.zeros(len(model.trainable_variables), np.float32)
    poison[-1] = _INF

    train_step(tf.constant(x), tf.constant(y), tf.constant(poison))

    assert bool(reference_should_apply)
    assert not np.isfinite(model.trainable_variables[-1].numpy()).all()
    assert int(optimizer.iterations) == 1
    assert int(optimizer.skipped_steps) == 0
    assert float(optimizer.loss_scale()) == 8.0


def test_apply_gradients_follows_the_protocol_of_the_last_scaling_call():
    # The same optimizer used with both protocols in turn must unscale the
    # gradients exactly once each time.
    model = models.tiny_model(hidden_units=2)
    reference_model = models.tiny_model(hidden_units=2)
    reference_optimizer = _sgd()
    optimizer = LossScaleOptimizer(_sgd(), loss_scale=64)
    steps = [_make_train_step(model, optimizer, protocol, use_function)
             for protocol in ("tf2", "keras")
             for use_function in (False, True)]
    no_poison = tf.zeros(len(model.trainable_variables))

    for step, train_step in enumerate(steps + steps):
        x, y = training.normal_data(4, seed=step)
        train_step(tf.constant(x), tf.constant(y), no_poison)
        _reference_step(reference_model, reference_optimizer, x, y)

        _assert_all_equal(model.weights, reference_model.weights)


def test_first_apply_without_variables_asks_for_them():
    optimizer = LossScaleOptimizer(_sgd())

    with pytest.raises(ValueError, match="trainable_variables"):
        optimizer.apply([tf.constant(1.0)])


@pytest.mark.parametrize("protocol", ["keras", "tf2"])
def test_sparse_embedding_gradients_are_unscaled_and_checked(protocol):
    def embedding_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((2,), dtype="int32"),
            keras.layers.Embedding(5, 3),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ])

    model, reference_model = embedding_model(), embedding_model()
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), loss_scale="dynamic")
    reference_optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    x = tf.constant([[0, 2], [4, 2]])
    y = tf.constant([[1.0], [-1.0]])

    @tf.function
    def train_step(embedding_poison):
        grads = _gradients_to_apply(
            optimizer, protocol, model, lambda: _loss(model, x, y))
        sparse = grads[0]
        assert isinstance(sparse, tf.IndexedSlices)
        grads[0] = tf.IndexedSlices(sparse.values + embedding_poison,
                                    sparse.indices, sparse.dense_shape)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    train_step(tf.constant(0.0))
    _reference_step(reference_model, reference_optimizer, x, y)
    _assert_all_equal(model.weights, reference_model.weights)
    weights = values_of(model.weights)

    train_step(tf.constant(_INF))

    _assert_all_equal(model.weights, weights)
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations) == 1


def test_wrapping_a_wrapper_is_both_a_type_and_a_value_error():
    # tf-keras' wrapper raises TypeError, TensorFlow's TF1 wrapper and
    # earlier releases ValueError: code written against either catches it.
    wrapper = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD())
    for caught in (TypeError, ValueError):
        with pytest.raises(caught, match="already a LossScaleOptimizer"):
            tf_lossscale.LossScaleOptimizer(wrapper)

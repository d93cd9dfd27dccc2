"""What both Keras wrappers share (`tf_lossscale.step.optimizer_protocol`).

The two protocols of a training step, as the Keras 3 wrapper runs them:
Keras 3's `scale_loss(loss)` (then `apply_gradients` with scaled gradients),
and TF 2.x's `get_scaled_loss(loss)` and `get_unscaled_gradients(grads)`
(then `apply_gradients` with unscaled ones): the loss multiplied by the
current scale in its own dtype, callables kept callable, gradients divided
exactly as TensorFlow divides them, whatever their structure and dtype. The
same protocol with tf-keras: tests/tf_keras/; custom loops that mix both:
tests/keras/test_keras_optimizer.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import reference_oracle as oracle
import tf_lossscale
from tf_lossscale import LossScaleOptimizer

pytestmark = pytest.mark.usefixtures("keras_isolation")

_FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]


@pytest.mark.parametrize("dtype",
                         [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_get_scaled_loss_multiplies_by_scale_and_keeps_dtype(dtype):
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.1), loss_scale=8)
    loss = tf.constant(3.0, dtype)

    scaled = optimizer.get_scaled_loss(loss)

    assert scaled.dtype == dtype
    assert float(scaled) == 3.0 * float(optimizer.loss_scale())


def test_get_scaled_loss_of_callable_is_callable_evaluated_on_call():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.1), loss_scale=8)
    calls = []

    def loss():
        calls.append(1)
        return tf.constant(3.0)

    scaled = optimizer.get_scaled_loss(loss)

    assert callable(scaled)
    assert not calls
    assert float(scaled()) == 3.0 * 8


def test_scale_loss_multiplies_by_current_scale():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.1),
        tf_lossscale.DynamicLossScale(16.0))

    assert float(optimizer.scale_loss(tf.constant(0.5))) == 8.0


def test_get_unscaled_gradients_keeps_structure_dtypes_none_and_slices():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.1), loss_scale=4)
    grads = [
        tf.constant([8.0, -2.0], tf.float16),
        None,
        tf.IndexedSlices(tf.constant([[4.0, 12.0]], tf.float32),
                         tf.constant([1]), tf.constant([3, 2])),
        tf.constant(1.0, tf.float64),
        tf.constant([2.0], tf.bfloat16),
    ]

    unscaled = optimizer.get_unscaled_gradients(grads)

    assert isinstance(unscaled, list) and len(unscaled) == len(grads)
    assert unscaled[1] is None
    for grad, result in zip(grads, unscaled):
        if grad is None:
            continue
        assert type(result) is type(grad)
        if isinstance(grad, tf.IndexedSlices):
            np.testing.assert_array_equal(result.indices, grad.indices)
            np.testing.assert_array_equal(result.dense_shape,
                                          grad.dense_shape)
            result, grad = result.values, grad.values
        assert result.dtype == grad.dtype
        np.testing.assert_array_equal(
            result.numpy().astype(np.float64),
            grad.numpy().astype(np.float64) / 4)


def test_float16_gradients_unscale_correctly_above_the_float16_range():
    # A dynamic scale can grow past the float16 maximum (65504); dividing by
    # it in float16 would flush every gradient to zero.
    scale = 2.0**20
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(learning_rate=0.1), loss_scale=scale)
    grad = tf.constant([1024.0, -2.0], tf.float16)

    unscaled, = optimizer.get_unscaled_gradients([grad])

    assert unscaled.dtype == tf.float16
    np.testing.assert_array_equal(
        unscaled.numpy(), (grad.numpy().astype(np.float64) / scale)
        .astype(np.float16))
    assert np.all(unscaled.numpy() != 0)


@pytest.mark.parametrize("scale", [2.0 ** 15, 1000.0, 3.0, 1.0],
                         ids=["power_of_two", "thousand", "three", "one"])
@pytest.mark.parametrize("dtype", _FLOAT_DTYPES, ids=lambda d: d.name)
def test_get_unscaled_gradients_is_bit_identical_to_divide(scale, dtype):
    rng = np.random.default_rng(1)
    grad = tf.cast(tf.constant(rng.standard_normal(5000) * 1e4), dtype)
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(), loss_scale=tf_lossscale.FixedLossScale(scale))
    unscaled, = optimizer.get_unscaled_gradients([grad])
    np.testing.assert_array_equal(
        tf.cast(unscaled, tf.float64).numpy(),
        tf.cast(oracle.reference_unscale(grad, scale), tf.float64).numpy())

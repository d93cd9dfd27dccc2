"""Documented refusals and layouts of the wrappers that nothing else pins:

* keras.md: "a wrapper refuses an optimizer that already scales the loss
  (`DoubleScalingError`)"; tf1.md: "wrapping a loss-scaling optimizer (this
  one or TensorFlow's) is refused" (the same exception class);
* migrating.md: `optimizer.variables` are "own state, the loss scale's
  variables, inner state", in that order;
* tf-keras.md: "Python numbers do not combine with it directly
  (`2 * opt.loss_scale` raises TypeError; tensors do)".
"""

import keras
import pytest
import tensorflow as tf

from tests.helpers import models
import tf_lossscale
from tf_lossscale import LossScaleOptimizer
from tf_lossscale.compat.v1 import MixedPrecisionLossScaleOptimizer

pytestmark = pytest.mark.usefixtures("keras_isolation")


@pytest.mark.parametrize("make_wrapper", [
    lambda: LossScaleOptimizer(keras.optimizers.SGD(0.1)),
    lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
], ids=["ours", "keras_own"])
def test_wrapping_a_loss_scaling_optimizer_raises_double_scaling_error(
        make_wrapper):
    wrapper = make_wrapper()
    with pytest.raises(tf_lossscale.DoubleScalingError,
                       match="scaled twice"):
        LossScaleOptimizer(wrapper)
    # Still catchable as what the constructor documents.
    assert issubclass(tf_lossscale.DoubleScalingError, ValueError)
    assert issubclass(tf_lossscale.DoubleScalingError, TypeError)


def test_an_inner_optimizer_wrapped_already_is_a_value_error_not_double_scaling():
    inner = keras.optimizers.SGD(0.1)
    LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="already wrapped") as raised:
        LossScaleOptimizer(inner)
    assert not isinstance(raised.value, tf_lossscale.DoubleScalingError)


@pytest.mark.parametrize("make_wrapper", [
    lambda: MixedPrecisionLossScaleOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)),
    lambda: tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), "dynamic"),
], ids=["ours", "tensorflows"])
def test_tf1_wrapper_of_a_loss_scaling_optimizer_raises_double_scaling_error(
        make_wrapper):
    wrapper = make_wrapper()
    with pytest.raises(tf_lossscale.DoubleScalingError,
                       match="scaled twice"):
        MixedPrecisionLossScaleOptimizer(wrapper)


def test_variables_are_own_state_then_the_loss_scale_then_the_inner_state():
    model = models.tiny_model(hidden_units=2)
    optimizer = LossScaleOptimizer(keras.optimizers.Adam())
    optimizer.build(model.trainable_variables)

    ids = [id(v) for v in optimizer.variables]
    scale = [id(v) for v in optimizer.loss_scale.variables]
    inner = [id(v) for v in optimizer.inner_optimizer.variables]
    own = optimizer.variables[:len(ids) - len(scale) - len(inner)]

    assert ids == [id(v) for v in own] + scale + inner
    assert "skipped_steps" in [v.name for v in own]


def test_python_numbers_do_not_combine_with_the_loss_scale_but_tensors_do():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tf_lossscale.DynamicLossScale(64.0))
    optimizer.apply_gradients([(tf.constant([float("nan")]),
                                tf.Variable([1.0]))])  # Skipped: 32.
    now = optimizer.loss_scale().numpy()

    for combine in (lambda s: 2 * s, lambda s: s * 2, lambda s: 2.0 + s):
        with pytest.raises(TypeError):
            combine(optimizer.loss_scale)
    loss = tf.constant(3.0)
    assert (loss * optimizer.loss_scale).numpy() == 3.0 * now
    assert (optimizer.loss_scale * loss).numpy() == now * 3.0

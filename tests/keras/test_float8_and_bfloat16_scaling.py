"""docs/guides/float8-bfloat16.md, two sentences no other test pins.

"With the TF 2.x protocol, `get_unscaled_gradients(grads)` is not given the
variables and unscales every gradient" (float8's `overwrite_with_gradient`
ones included); "A `LossScaleOptimizer` created under a bfloat16 policy
with any loss scale other than a fixed 1 warns (a `UserWarning`)".
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

pytestmark = pytest.mark.usefixtures("keras_isolation")

_SCALE = 1024.0


def test_get_unscaled_gradients_unscales_float8_gradients_too():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    model.quantize("float8")
    variables = model.trainable_variables
    passed_through = [getattr(v, "overwrite_with_gradient", False)
                      for v in variables]
    assert any(passed_through) and not all(passed_through)
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        loss_scale=tf_lossscale.FixedLossScale(_SCALE))
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.standard_normal(v.shape).astype(np.float32))
             for v in variables]

    unscaled = optimizer.get_unscaled_gradients(grads)

    for grad, result in zip(grads, unscaled):
        np.testing.assert_array_equal(np.asarray(result),
                                      np.asarray(grad) / _SCALE)


def _bfloat16_warnings(loss_scale):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(),
                                        loss_scale=loss_scale)
    return [w for w in caught if "bfloat16" in str(w.message)]


@pytest.mark.parametrize("loss_scale", [
    "dynamic", 2, lambda: tf_lossscale.FixedLossScale(2.0),
    lambda: tf_lossscale.DynamicLossScale(initial_loss_scale=1.0),
    lambda: tf_lossscale.FixedLossScale(4, skip_non_finite=True),
], ids=["dynamic", "two", "fixed_two", "dynamic_from_one",
        "fixed_four_skipping"])
def test_scaling_under_bfloat16_warns_a_user_warning(loss_scale):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")

    caught = _bfloat16_warnings(
        loss_scale() if callable(loss_scale) else loss_scale)

    assert [w.category for w in caught] == [UserWarning]
    assert "FixedLossScale(1, skip_non_finite=True)" in str(caught[0].message)


@pytest.mark.parametrize("loss_scale", [
    lambda: tf_lossscale.FixedLossScale(1, skip_non_finite=True),
    lambda: tf_lossscale.FixedLossScale(1.0),
], ids=["fixed_one_skipping", "fixed_one"])
def test_a_fixed_1_under_bfloat16_does_not_warn(loss_scale):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")

    assert not _bfloat16_warnings(loss_scale())

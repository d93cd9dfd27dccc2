"""The step every wrapper runs (`tf_lossscale.step.loss_scaled_step`).

Each wrapper hands one step's gradients to the shared step, which agrees on
one finiteness flag across replicas, updates the loss scale from it and
applies the unscaled gradients or skips the step. Pinned here through the
Keras 3 wrapper: applied steps are bit-identical to the inner optimizer on
gradients divided by TensorFlow's formula,
`cast(cast(g, float32) / cast(S, float32), g.dtype)`; and a user-defined
`LossScale` with only the public contract still gets `update(grads)` with
the unscaled gradients, its verdict deciding the skip.

The parts of the step have files of their own: the finiteness check
(test_gradient_checks.py, test_gradient_check_exactness.py), the unscaling
(test_unscaling.py), the overflow record (test_nonfinite_flags.py,
test_last_nonfinite_variables.py), the failure policy and the state check
(test_failure_policy.py, test_scale_state_checks.py); the step's agreement
across replicas is pinned by each wrapper's tests under MirroredStrategy.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import reference_oracle as oracle
import tf_lossscale

pytestmark = pytest.mark.usefixtures("keras_isolation")

_NAN = float("nan")


@pytest.mark.parametrize("loss_scale", [
    lambda: tf_lossscale.DynamicLossScale(1000.0, increment_period=2),
    lambda: tf_lossscale.DynamicLossScale(2.0 ** 10, increment_period=2,
                                          multiplier=3.0),
    lambda: tf_lossscale.FixedLossScale(3.0),
], ids=["dynamic_1000", "dynamic_multiplier_3", "fixed_3"])
def test_applied_steps_are_bit_identical_to_sgd_on_divided_gradients(
        loss_scale):
    rng = np.random.default_rng(2)
    initial = rng.standard_normal((300, 301)).astype(np.float32)
    ours_weights = tf.Variable(initial)
    reference_weights = tf.Variable(initial)
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.5), loss_scale=loss_scale())
    reference = keras.optimizers.SGD(0.5)

    @tf.function
    def step(scaled):
        scale = optimizer.loss_scale()
        optimizer.scale_loss(tf.constant(1.0))  # The Keras protocol.
        optimizer.apply([scaled], [ours_weights])
        reference.apply([oracle.reference_unscale(scaled, scale)],
                        [reference_weights])

    for _ in range(5):
        step(tf.constant(rng.standard_normal((300, 301)) * 3e3, tf.float32))
    np.testing.assert_array_equal(ours_weights.numpy(),
                                  reference_weights.numpy())


class _RecordingLossScale(tf_lossscale.LossScale):
    """A user-defined loss scale: only the public contract."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __call__(self):
        return tf.constant(4.0)

    def update(self, grads):
        self.seen.append([g.numpy() for g in grads])
        return None, bool(np.isfinite(np.concatenate(
            [np.ravel(g) for g in self.seen[-1]])).all())

    def get_config(self):
        return {}


def test_user_loss_scale_without_private_hooks_gets_update_with_unscaled():
    variable = tf.Variable([1.0, 1.0])
    loss_scale = _RecordingLossScale()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), loss_scale=loss_scale)
    optimizer.scale_loss(tf.constant(1.0))
    optimizer.apply([tf.constant([4.0, 8.0])], [variable])
    optimizer.apply([tf.constant([4.0, _NAN])], [variable])
    np.testing.assert_array_equal(loss_scale.seen[0][0], [1.0, 2.0])
    np.testing.assert_array_equal(variable.numpy(), [0.0, -1.0])
    assert int(optimizer.skipped_steps) == 1

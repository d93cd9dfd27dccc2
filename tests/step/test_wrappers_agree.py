"""Every LossScaleOptimizer wrapper (Keras 3, tf-keras, TF1) raises the same
exception for a step called in cross-replica context, and the Keras 3 and
tf-keras wrappers report the same `last_nonfinite_variables()` for the same
model (`tf_lossscale._internal.checks.replica_context`,
`tf_lossscale.step.optimizer_protocol`)."""

import inspect
import json

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.helpers import training
import tf_lossscale
from tf_lossscale._internal import checks as validation

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _cross_replica_step(make_optimizer):
    """The error of `apply_gradients` called directly under a strategy's
    scope, with the variable's value after it."""
    strategy = training.mirrored(2)
    with strategy.scope():
        variable = tf.Variable([1.0, 2.0])
        optimizer = make_optimizer()
        with pytest.raises(Exception) as raised:
            optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])
    return raised.value, variable.numpy().tolist()


_WRAPPERS = {
    "keras3": lambda: tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD()),
    "tf_keras": lambda: tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.SGD()),
    "tf_keras_legacy": lambda: tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.legacy.SGD()),
    "tf1": lambda: tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), "dynamic"),
}


def test_every_wrapper_refuses_cross_replica_context_with_one_error():
    messages = set()
    for kind, make_optimizer in _WRAPPERS.items():
        error, value = _cross_replica_step(make_optimizer)
        assert type(error) is validation.ReplicaContextError, (kind, error)
        # Code written against either earlier type keeps catching it.
        assert isinstance(error, ValueError), kind
        assert isinstance(error, RuntimeError), kind
        assert value == [1.0, 2.0], kind
        messages.add(str(error))
    assert len(messages) == 1, messages
    assert "replica context" in messages.pop()


def _overflowed_variables(k):
    """`last_nonfinite_variables()` after a step of one functional model,
    built with the Keras module `k`, with a NaN and an Inf in two of its
    gradients. Runs here with Keras 3 and in the tf-keras interpreter."""
    inputs = k.Input((2,))
    hidden = k.layers.Dense(3, name="hidden")(inputs)
    model = k.Model(inputs, k.layers.Dense(1, name="out")(hidden))
    optimizer = tf_lossscale.LossScaleOptimizer(k.optimizers.SGD(0.1))
    grads = [np.ones(v.shape, np.float32) for v in model.trainable_variables]
    grads[1][0] = np.nan  # hidden/bias
    grads[2][1, 0] = np.inf  # out/kernel
    optimizer.apply_gradients(zip(
        [tf.constant(g) for g in grads], model.trainable_variables))
    assert int(optimizer.skipped_steps) == 1
    return optimizer.last_nonfinite_variables()


def test_keras_3_and_tf_keras_report_the_same_overflowed_variables(
        tf_keras_interpreter):
    keras_3 = _overflowed_variables(keras)
    assert keras_3 == ["hidden/bias", "out/kernel"]
    # The same function in the session's process where `tf.keras` is
    # tf-keras (TF_USE_LEGACY_KERAS=1), not a process of its own.
    printed = tf_keras_interpreter.run(
        "import json\nimport numpy as np\nimport tensorflow as tf\n"
        "import tf_keras\nimport tf_lossscale\n"
        + inspect.getsource(_overflowed_variables)
        + "print(json.dumps(_overflowed_variables(tf_keras)))\n")
    assert json.loads(printed[-1]) == keras_3


def test_tf_keras_reports_paths_in_process():
    """The tf-keras wrapper used with tf_keras optimizers directly (Keras 3
    being `tf.keras`): paths, not names with `:0`."""
    variables = [tf.Variable([1.0], name="finite"),
                 tf.Variable([2.0], name="overflowing")]
    for inner in (tf_keras.optimizers.SGD(0.1),
                  tf_keras.optimizers.legacy.SGD(0.1)):
        optimizer = tf_lossscale.LossScaleOptimizer(inner)
        optimizer.apply_gradients(zip(
            [tf.constant([1.0]), tf.constant([np.nan])], variables))
        assert optimizer.last_nonfinite_variables() == ["overflowing"]

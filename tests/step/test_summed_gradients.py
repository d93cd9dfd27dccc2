"""The step decides on the gradients summed over the replicas: what the
optimizer applies. A finite sum is applied once (not summed twice), a sum
that overflows float32 is skipped everywhere with its variable named, and
gradients the caller summed are taken as they are."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_lossscale
from tests.helpers import training

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _replica_values(strategy, variable):
    if isinstance(variable, keras.Variable):
        variable = variable.value  # Its tf.Variable, mirrored.
    return [np.array(local.numpy())
            for local in strategy.experimental_local_results(variable)]


def _step(strategy, optimizer, variable, grad_of_replica, **apply_kwargs):
    @tf.function
    def step():
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            grad = grad_of_replica(tf.cast(replica, tf.float32))
            optimizer.apply_gradients([(grad, variable)], **apply_kwargs)
        strategy.run(replica_step)
    step()


def _keras_3(strategy):
    with strategy.scope():
        variable = keras.Variable([1.0, 1.0], name="big")
        optimizer = tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(1.0), tf_lossscale.DynamicLossScale(1.0))
        optimizer.build([variable])
    return variable, optimizer


def test_each_replicas_finite_gradient_is_summed_once_and_applied():
    strategy = training.mirrored(2)
    variable, optimizer = _keras_3(strategy)
    # Replica 0's gradient is 1, replica 1's is 2: the sum is 3.
    _step(strategy, optimizer, variable,
          lambda replica: tf.fill([2], replica + 1.0))
    for copy in _replica_values(strategy, variable):
        np.testing.assert_array_equal(copy, [-2.0, -2.0])
    assert int(optimizer.skipped_steps) == 0


def test_finite_gradients_whose_sum_overflows_skip_on_every_replica():
    strategy = training.mirrored(2)
    variable, optimizer = _keras_3(strategy)
    before = _replica_values(strategy, variable)
    # Each replica's gradient is finite; their float32 sum is +Inf, which
    # applying would write into the weights.
    _step(strategy, optimizer, variable, lambda replica: tf.fill([2], 3e38))
    for copy, old in zip(_replica_values(strategy, variable), before):
        np.testing.assert_array_equal(copy, old)
    assert int(optimizer.skipped_steps) == 1
    assert optimizer.last_nonfinite_variables() == ["big"]


@pytest.mark.parametrize("legacy", [False, True], ids=["optimizer", "legacy"])
def test_tf_keras_gradients_the_caller_summed_are_applied_as_given(legacy):
    strategy = training.mirrored(2)
    make = (tf_keras.optimizers.legacy.SGD if legacy
            else tf_keras.optimizers.SGD)
    with strategy.scope():
        variable = tf.Variable([1.0, 1.0], name="summed")
        optimizer = tf_lossscale.LossScaleOptimizer(
            make(1.0), dynamic=True, initial_scale=1.0)

    def summed_by_caller(grad):
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, grad)

    flag = ({"experimental_aggregate_gradients": False} if legacy
            else {"skip_gradients_aggregation": True})
    _step(strategy, optimizer, variable,
          lambda replica: summed_by_caller(tf.fill([2], replica + 1.0)),
          **flag)
    for copy in _replica_values(strategy, variable):
        np.testing.assert_array_equal(copy, [-2.0, -2.0])
    # A NaN on replica 1 in the caller's sum skips every replica; so does
    # one the caller left on replica 1 only, after its sum: the step cannot
    # know the caller's replicas hold the same sums, and agrees on them.
    nan_on_one = lambda replica: tf.where(replica > 0.0, np.nan, 0.0)  # pylint: disable=unnecessary-lambda-assignment
    for grad_of_replica in (
            lambda r: summed_by_caller(tf.fill([2], 1.0) + nan_on_one(r)),
            lambda r: summed_by_caller(tf.fill([2], 1.0)) + nan_on_one(r)):
        _step(strategy, optimizer, variable, grad_of_replica, **flag)
        for copy in _replica_values(strategy, variable):
            np.testing.assert_array_equal(copy, [-2.0, -2.0])
    assert int(optimizer.skipped_steps) == 2

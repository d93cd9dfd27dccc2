"""Two TF1 wrappers (`compat.v1.MixedPrecisionLossScaleOptimizer`) in one
`LossScaleGroup`, in a TF1 graph and Session: each skips on its own
gradients, the scale takes one step per iteration, and a wrapper stepping
twice in an iteration fails its step, changing nothing."""

import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale


def test_two_tf1_wrappers_share_one_step_of_the_scale_per_iteration():
    graph = tf.Graph()
    with graph.as_default():
        group = tf_lossscale.LossScaleGroup(
            tf_lossscale.DynamicLossScale(8.0, 1))
        a = tf.compat.v1.get_variable("a", initializer=[1.0])
        b = tf.compat.v1.get_variable("b", initializer=[2.0])
        poison = tf.compat.v1.placeholder(tf.float32, [])
        # Every optimizer joins before the first step is built.
        optimizers = [tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), group)
                      for _ in range(2)]
        steps = [
            optimizer.minimize(loss, var_list=[variable])
            for optimizer, (loss, variable) in zip(optimizers, (
                (tf.reduce_sum(a * a), a),
                # NaN times b: b's gradient only.
                (tf.reduce_sum(b * b * (1.0 + poison)), b)))]
        state = [group(), a, b, *group.variables]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            seen = []
            for value in (0.0, np.nan, 0.0):
                for step in steps:
                    session.run(step, {poison: value})
                seen.append(session.run(state))
            before = session.run(state)
            session.run(steps[0], {poison: 0.0})
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="stepped twice in one iteration"):
                session.run(steps[0], {poison: 0.0})
            after = session.run(state)
    # Period 1: each finite iteration doubles the scale, the NaN one halves
    # it; a applies every step, b skips the poisoned one.
    assert [float(s[0]) for s in seen] == [16.0, 8.0, 16.0]
    np.testing.assert_allclose([s[1][0] for s in seen], [0.8, 0.64, 0.512])
    np.testing.assert_array_equal([s[2][0] for s in seen[:2]],
                                  np.float32([1.6, 1.6]))
    # The refused step changed nothing but what its iteration's first step
    # did (a applied once more, a's bit set).
    assert after[3] == 0b01 and before[3] == 0
    assert float(after[0]) == float(before[0])

"""In a TF1 graph, `update`'s skip decision comes from the gradients alone.

TensorFlow's reference `tf.compat.v1.mixed_precision.DynamicLossScale`
returns the gradients' finiteness as `should_apply_gradients`, so TF1 code
(and TensorFlow's own `test_single_tensor_gradient`) can evaluate it in a
`Session` before running any initializer. tf_lossscale's loss scales do the
same there, while their `update_op` still checks the state, moves it and
applies the failure policy: run on a state that cannot be right, it fails the
step and changes no variable.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

_NAN = float("nan")
_INF = float("inf")

_LOSS_SCALES = {
    "dynamic_defaults": tf_lossscale.DynamicLossScale,
    "dynamic_every_feature": lambda: tf_lossscale.DynamicLossScale(
        initial_loss_scale=8, hysteresis=3, on_min_loss_scale="raise",
        max_consecutive_skips=4),
    "fixed_skipping": lambda: tf_lossscale.FixedLossScale(
        8, skip_non_finite=True),
}

# (gradients, whether they are all finite). The single tensor is the input of
# TensorFlow's `test_single_tensor_gradient`.
_GRADIENTS = {
    "single_tensor": (lambda: tf.constant(4.0), True),
    "finite_list_with_none": (
        lambda: [tf.constant([1.0, 2.0]), None, tf.constant(3.0)], True),
    "nan_past_the_first": (
        lambda: [tf.constant([1.0, 2.0]), tf.constant([3.0, _NAN])], False),
    "inf": (lambda: {"w": tf.constant([_INF]), "b": None}, False),
    "minus_inf_float16": (
        lambda: [tf.constant([-_INF, 1.0], tf.float16)], False),
}


def _reference_should_apply(grads):
    _, should_apply = tf.compat.v1.mixed_precision.DynamicLossScale().update(
        grads)
    return should_apply


@pytest.mark.parametrize("grads", _GRADIENTS)
@pytest.mark.parametrize("loss_scale", _LOSS_SCALES)
def test_should_apply_evaluates_before_any_initializer_like_the_reference(
        loss_scale, grads):
    make_grads, finite = _GRADIENTS[grads]
    with tf.Graph().as_default():
        ours = _LOSS_SCALES[loss_scale]()
        _, should_apply = ours.update(make_grads())
        reference = _reference_should_apply(make_grads())
        uninitialized = tf.compat.v1.report_uninitialized_variables()
        with tf.compat.v1.Session() as session:
            got, want = session.run([should_apply, reference])
            still_uninitialized = session.run(uninitialized)
    assert bool(got) is bool(want) is finite
    # Every variable of both loss scales still waits for its initializer.
    assert len(still_uninitialized) == len(ours.variables) + 2


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "nan"])
def test_should_apply_alone_leaves_the_state_and_update_op_moves_it(finite):
    with tf.Graph().as_default():
        ours = tf_lossscale.DynamicLossScale(initial_loss_scale=8,
                                             increment_period=1)
        reference = tf.compat.v1.mixed_precision.DynamicLossScale(
            initial_loss_scale=8, increment_period=1)
        grads = [tf.constant([1.0, 1.0 if finite else _NAN])]
        update_op, should_apply = ours.update(grads)
        reference_update, _ = reference.update(grads)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            before = session.run(list(ours.variables))
            for _ in range(2):
                assert bool(session.run(should_apply)) is finite
            unchanged = session.run(list(ours.variables))
            session.run([update_op, reference_update])
            scale, reference_scale = session.run([ours(), reference()])
    assert unchanged == before
    assert scale == reference_scale != before[0]


def _state(session, loss_scale):
    return session.run(list(loss_scale.variables))


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "nan"])
@pytest.mark.parametrize("loss_scale", ["dynamic_defaults",
                                        "dynamic_every_feature"])
def test_update_op_on_a_nan_scale_fails_and_changes_nothing(loss_scale,
                                                            finite):
    with tf.Graph().as_default():
        ours = _LOSS_SCALES[loss_scale]()
        grads = [tf.constant([1.0, 1.0 if finite else _NAN])]
        update_op, should_apply = ours.update(grads)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(ours.variables[0].assign(_NAN))
            before = _state(session, ours)
            for fetch in (update_op, [update_op, should_apply]):
                with pytest.raises(tf.errors.InvalidArgumentError,
                                   match="current_loss_scale"):
                    session.run(fetch)
                np.testing.assert_array_equal(
                    np.array(_state(session, ours), dtype=np.float64),
                    np.array(before, dtype=np.float64))
            # The decision alone still only looks at the gradients.
            assert bool(session.run(should_apply)) is finite

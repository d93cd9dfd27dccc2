"""tf-keras users' code keeps working when tf-keras' wrapper becomes ours.

Each test runs the same code under `tf_keras.mixed_precision.
LossScaleOptimizer` (the reference) and under `tf_lossscale.LossScaleOptimizer`
in this process (with `tf_keras` imported directly) and compares what a user
sees: aggregation before the check, how the inner optimizer is called, TF 2.2
checkpoints, `loss_scale` read as a number, the warning for a loss that was
never scaled, and `isinstance`. Saved-model journeys with
`TF_USE_LEGACY_KERAS=1` are in `tf_keras_journeys.py`.
"""

import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests import helpers
import tf_lossscale
from tf_lossscale.tf_keras import loss_scale_optimizer as tf_keras_optimizer

pytestmark = pytest.mark.usefixtures("keras_isolation")

_NAN = float("nan")
_KINDS = {
    "optimizer": tf_keras.optimizers.SGD,
    "legacy": tf_keras.optimizers.legacy.SGD,
}
_WRAPPERS = {
    "theirs": tf_keras.mixed_precision.LossScaleOptimizer,
    "ours": tf_lossscale.LossScaleOptimizer,
}
_REPO = str(helpers.ROOT)


def _nan_in_last(grads_and_vars):
    """An aggregate whose last gradient is NaN, as if one replica's were."""
    pairs = list(grads_and_vars)
    grad, variable = pairs[-1]
    pairs[-1] = (grad * _NAN, variable)
    return pairs


class _NanAggregatingSGD(tf_keras.optimizers.SGD):
    """The new optimizers' aggregation hook, overridden by a user."""

    def aggregate_gradients(self, grads_and_vars):
        return _nan_in_last(grads_and_vars)


def _nan_aggregating(kind):
    if kind == "legacy":
        return tf_keras.optimizers.legacy.SGD(
            1.0, gradient_aggregator=_nan_in_last)
    return _NanAggregatingSGD(1.0)


@pytest.mark.parametrize("in_function", [False, True])
@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_a_nan_made_by_the_aggregation_is_skipped_counted_and_backs_off(
        kind, in_function):
    variables = [tf.Variable([1.0, 2.0]), tf.Variable([3.0])]
    optimizer = tf_lossscale.LossScaleOptimizer(
        _nan_aggregating(kind), initial_scale=2, dynamic_growth_steps=2)

    def step():
        optimizer.minimize(
            lambda: tf.reduce_sum(variables[0] * 2) + variables[1][0],
            var_list=variables)

    (tf.function(step) if in_function else step)()
    np.testing.assert_equal([v.numpy() for v in variables],
                            [[1.0, 2.0], [3.0]])
    assert int(optimizer.skipped_steps) == 1
    assert float(optimizer.loss_scale()) == 1.0
    assert int(optimizer.iterations) == 0
    # Only the aggregate's NaN gradient is recorded.
    assert optimizer.last_nonfinite_variables() == [
        variables[1].name.split(":")[0]]


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_gradients_the_caller_aggregated_are_not_aggregated_again(kind):
    results = {}
    for which, wrap in _WRAPPERS.items():
        optimizer = wrap(_nan_aggregating(kind), dynamic=False,
                         initial_scale=1)
        optimizer.get_scaled_loss(tf.constant(1.0))
        variable = tf.Variable([1.0])
        pairs = list(zip(optimizer.get_unscaled_gradients(
            [tf.constant([1.0])]), [variable]))
        if kind == "legacy":  # OptimizerV2's positional arguments.
            optimizer.apply_gradients(pairs, None, False)
        else:
            optimizer.apply_gradients(pairs, skip_gradients_aggregation=True)
        results[which] = variable.numpy()
    np.testing.assert_equal(results["ours"], results["theirs"])
    np.testing.assert_equal(results["ours"], [0.0])


def _recording(kind, calls):
    """An optimizer whose apply_gradients has tf-keras' signature for its
    kind minus `name` (the new kind) and records how it is called."""
    if kind == "legacy":
        class Recording(tf_keras.optimizers.legacy.SGD):
            def apply_gradients(self, grads_and_vars, name=None,
                                experimental_aggregate_gradients=True):
                calls.append({"name": name, "experimental_aggregate_gradients":
                              experimental_aggregate_gradients})
                return super().apply_gradients(
                    grads_and_vars, name, experimental_aggregate_gradients)
    else:
        class Recording(tf_keras.optimizers.SGD):
            def apply_gradients(self, grads_and_vars,
                                skip_gradients_aggregation=False,
                                experimental_aggregate_gradients=True):
                calls.append({"skip_gradients_aggregation":
                              skip_gradients_aggregation,
                              "experimental_aggregate_gradients":
                              experimental_aggregate_gradients})
                return super().apply_gradients(
                    grads_and_vars,
                    skip_gradients_aggregation=skip_gradients_aggregation)
    return Recording(1.0)


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_the_inner_apply_gradients_is_called_as_tf_keras_calls_it(kind):
    seen, results = {}, {}
    for which, wrap in _WRAPPERS.items():
        seen[which] = []
        optimizer = wrap(_recording(kind, seen[which]), dynamic=False,
                         initial_scale=1)
        variable = tf.Variable([5.0])
        optimizer.minimize(lambda: variable * 2.0, [variable])
        results[which] = variable.numpy()
    assert seen["ours"] == seen["theirs"] and len(seen["ours"]) == 1
    np.testing.assert_equal(results["ours"], results["theirs"])


def _tf22_checkpoint():
    """tf-keras' TF 2.2 checkpoint, read in place from the project's shared
    folder beside the repository (`<repo>/../shared`; a worktree at
    `<project>/wt/<branch>` finds it one level further up)."""
    relative = ("tfkeras-mixed-precision-testdata/org_keras/tf_keras/"
                "mixed_precision/testdata/lso_ckpt_tf2.2/ckpt")
    candidates = [os.path.join(_REPO, "..", "shared", relative),
                  os.path.join(_REPO, "..", "..", "shared", relative)]
    for path in candidates:
        if os.path.exists(path + ".index"):
            return path
    raise FileNotFoundError(f"tf-keras' TF 2.2 checkpoint not in {candidates}")


def _checkpointed_momentum(path):
    """The momentum slot of the Dense kernel as the checkpoint holds it."""
    reader = tf.train.load_checkpoint(path)
    keys = [key for key in reader.get_variable_to_shape_map()
            if "kernel" in key and "momentum" in key]
    assert len(keys) == 1, keys
    return reader.get_tensor(keys[0])


def _restored_from_tf22(wrap, path):
    model = tf_keras.Sequential([tf_keras.layers.Dense(2)])
    optimizer = wrap(tf_keras.optimizers.legacy.SGD(0.1, momentum=0.1))
    model.load_weights(path)
    model.compile(optimizer, "mse")
    model(np.zeros((2, 2)))
    optimizer._create_all_weights(model.weights)  # pylint: disable=protected-access
    return model, optimizer


def _restored_state(model, optimizer):
    return (model.weights[0].numpy(),
            optimizer.get_slot(model.weights[0], "momentum").numpy(),
            float(optimizer.loss_scale), int(optimizer.dynamic_counter))


def test_tf22_checkpoint_restores_slots_before_and_after_fit():
    path = _tf22_checkpoint()
    momentum = _checkpointed_momentum(path)
    assert np.abs(momentum).sum() > 0
    restored, states = {}, {}
    for which, wrap in _WRAPPERS.items():
        restored[which] = _restored_from_tf22(wrap, path)
        model, optimizer = restored[which]
        np.testing.assert_equal(
            optimizer.get_slot(model.weights[0], "momentum").numpy(),
            momentum)
        states[which] = _restored_state(model, optimizer)
    for ours, theirs in zip(states["ours"], states["theirs"]):
        np.testing.assert_equal(ours, theirs)
    x, y = np.random.default_rng(0).normal(size=(2, 2, 2))
    for which, (model, _) in restored.items():
        model.fit(x, y, verbose=0)
        model.load_weights(path)  # Slots exist now: restored at once.
    moved = _restored_state(*restored["ours"])
    np.testing.assert_equal(moved[1], momentum)
    for ours, theirs in zip(moved, _restored_state(*restored["theirs"])):
        np.testing.assert_equal(ours, theirs)


def _trained_to_a_lower_scale(loss_scale):
    """A Keras 3 and a tf-keras wrapper after one skipped step."""
    optimizers = [
        tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                        loss_scale=loss_scale()),
        tf_lossscale.LossScaleOptimizer(tf_keras.optimizers.SGD(0.1),
                                        loss_scale=loss_scale()),
    ]
    for optimizer in optimizers:
        optimizer.apply_gradients([(tf.constant([_NAN]), tf.Variable([1.0]))])
    return optimizers


@pytest.mark.parametrize("loss_scale", [
    lambda: tf_lossscale.DynamicLossScale(64.0),
    lambda: tf_lossscale.FixedLossScale(8, skip_non_finite=True),
])
def test_loss_scale_reads_as_the_current_scale_wherever_a_tensor_would(
        loss_scale):
    for optimizer in _trained_to_a_lower_scale(loss_scale):
        scale = optimizer.loss_scale
        now = optimizer.loss_scale().numpy()
        assert isinstance(scale, tf_lossscale.LossScale)  # Still callable.
        assert float(scale) == now and np.asarray(scale) == now
        assert tf_keras.backend.get_value(scale) == now
        assert keras.ops.convert_to_numpy(scale) == now
        assert tf.is_tensor(scale) and scale.dtype == tf.float32
        assert tf.cast(scale, tf.float16).numpy() == np.float16(now)
        assert (tf.constant(2.0) * scale).numpy() == 2 * now
        assert tf.function(lambda s=scale: s * 2.0)().numpy() == 2 * now
        with pytest.raises(ValueError, match="requested dtype int32"):
            tf.convert_to_tensor(scale, dtype=tf.int32)


def test_loss_scale_is_fetched_by_a_tf1_session_without_growing_the_graph():
    with tf.Graph().as_default() as graph:
        variable = tf.compat.v1.get_variable("v", initializer=[1.0])
        optimizer = tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), "dynamic")
        step = optimizer.minimize(tf.reduce_sum(variable * _NAN))
        scale = optimizer.loss_scale
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            before = session.run(scale)
            ops = len(graph.get_operations())
            session.run(step)
            after = session.run(scale)
            assert len(graph.get_operations()) == ops
            assert session.run([scale, scale()]) == [after, after]
    assert (before, after) == (2.0**15, 2.0**14)


class _CapturedTfWarnings:
    """Records what TensorFlow's logger emits at WARNING and above, whatever
    level earlier tests left it at."""

    def __enter__(self):
        self.records = []
        self._handler = logging.Handler(logging.WARNING)
        self._handler.emit = self.records.append
        self._level = tf.get_logger().level
        tf.get_logger().setLevel(logging.WARNING)
        tf.get_logger().addHandler(self._handler)
        return self.records

    def __exit__(self, *exc_info):
        tf.get_logger().removeHandler(self._handler)
        tf.get_logger().setLevel(self._level)


@pytest.mark.parametrize("kind", sorted(_KINDS))
@pytest.mark.parametrize("calls,warned", [
    ((), "get_scaled_loss() and LossScaleOptimizer.get_unscaled_gradients()"),
    (("get_unscaled_gradients",), "get_scaled_loss() before"),
    (("get_scaled_loss", "get_unscaled_gradients"), None),
])
def test_gradients_of_an_unscaled_loss_are_applied_as_given_with_tf_keras_warning(
        kind, calls, warned):
    values, messages = {}, {}
    for which, wrap in _WRAPPERS.items():
        optimizer = wrap(_KINDS[kind](1.0))
        variable = tf.Variable(1.0)
        if "get_scaled_loss" in calls:
            optimizer.get_scaled_loss(tf.constant(1.0))
        if "get_unscaled_gradients" in calls:
            optimizer.get_unscaled_gradients([tf.constant(1.0)])
        with _CapturedTfWarnings() as records:
            optimizer.apply_gradients([(tf.constant(1.0), variable)])
        values[which] = variable.numpy()
        messages[which] = [r.getMessage() for r in records
                           if "You forgot to call" in r.getMessage()]
    np.testing.assert_equal(values["ours"], values["theirs"])
    for which in _WRAPPERS:
        if warned is None:
            assert not messages[which], (which, messages)
        else:
            assert len(messages[which]) == 1 and warned in messages[which][0]


def test_scale_loss_protocol_still_unscales_without_a_warning():
    optimizer = tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.SGD(1.0), loss_scale=4)
    variable = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        scaled = optimizer.scale_loss(variable * 1.0)
    with _CapturedTfWarnings() as records:
        optimizer.apply_gradients(
            [(tape.gradient(scaled, variable), variable)])
    assert variable.numpy() == 0.0
    assert not [r for r in records if "You forgot" in r.getMessage()]


def test_one_name_answers_isinstance_for_every_keras():
    made = [tf_lossscale.LossScaleOptimizer(kind())
            for kind in _KINDS.values()]
    made.append(tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD()))
    for optimizer in made:
        assert isinstance(optimizer, tf_lossscale.LossScaleOptimizer)
    assert issubclass(tf_keras_optimizer.LegacyLossScaleOptimizer,
                      tf_lossscale.LossScaleOptimizer)
    not_ours = [tf_keras.mixed_precision.LossScaleOptimizer(
                    tf_keras.optimizers.SGD()),
                keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
                tf_keras.optimizers.SGD(), keras.optimizers.SGD(), None]
    for optimizer in not_ours:
        assert not isinstance(optimizer, tf_lossscale.LossScaleOptimizer)

    class Mine(tf_lossscale.LossScaleOptimizer):
        pass

    # A subclass of the Keras 3 class answers only for its own instances.
    assert not isinstance(made[0], Mine)

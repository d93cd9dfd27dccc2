"""Behaviour of `DynamicLossScale` on one device, in every execution mode.

Expected scales and good-step counts come from TensorFlow's reference
`tf.compat.v1.mixed_precision.DynamicLossScale`, run eagerly on the same
steps. The scenarios are the ones TensorFlow's own tests use; randomized
parity lives in another file.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
import tf_lossscale

_NAN = float("nan")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
T, F = True, False

_SCENARIOS = {
    "grows_every_period": (
        dict(initial_loss_scale=1, increment_period=2, multiplier=2),
        [T] * 6),
    "backs_off_down_to_one": (
        dict(initial_loss_scale=16, increment_period=2, multiplier=2),
        [F] * 6),
    "non_finite_resets_good_steps": (
        dict(initial_loss_scale=1, increment_period=2, multiplier=2),
        [T, T, T, F, T]),
    "period_one_grows_every_step": (
        dict(initial_loss_scale=1, increment_period=1, multiplier=2),
        [T, T, T, F, T, T]),
    "multiplier_three": (
        dict(initial_loss_scale=4, increment_period=2, multiplier=3),
        [T, T, F, T, T]),
    "never_grows_past_float32_max": (
        dict(initial_loss_scale=_FLOAT32_MAX / 4, increment_period=1,
             multiplier=2),
        [T, T, T, T]),
}
# The graph modes replay the scenarios that exercise both branches.
_MODE_SCENARIOS = ["non_finite_resets_good_steps", "period_one_grows_every_step"]


def _last_gradient(finite):
    return tf.constant([3.0, 1.0 if finite else _NAN])


def _grads(last):
    # The bad value sits in the second gradient: the check must look past the
    # first one.
    return [tf.constant([1.0, 2.0]), last]


def _reference_trace(config, steps):
    """(scale, good_steps, should_apply) after each step, from TF's reference."""
    reference = tf.compat.v1.mixed_precision.DynamicLossScale(**config)
    state = tf.train.TrackableView(reference).children(reference)
    trace = []
    for finite in steps:
        _, should_apply = reference.update(_grads(_last_gradient(finite)))
        trace.append((float(reference()), int(state["good_steps"].numpy()),
                      bool(should_apply)))
    return trace


def _eager_trace(config, steps):
    loss_scale = tf_lossscale.DynamicLossScale(**config)
    trace = []
    for finite in steps:
        update_op, should_apply = loss_scale.update(
            _grads(_last_gradient(finite)))
        assert update_op is None
        trace.append((float(loss_scale()), int(loss_scale.good_steps),
                      bool(should_apply)))
    return trace


def _tf_function_trace(config, steps, jit_compile=False):
    loss_scale = tf_lossscale.DynamicLossScale(**config)
    traced = []

    @tf.function(jit_compile=jit_compile)
    def step(last):
        update_op, should_apply = loss_scale.update(_grads(last))
        traced.append((update_op, should_apply))
        return should_apply

    if jit_compile:  # The state check runs on the host after each call.
        step = tf_lossscale.with_xla_checks(step, loss_scale)
    trace = []
    for finite in steps:
        should_apply = step(_last_gradient(finite))
        trace.append((float(loss_scale()), int(loss_scale.good_steps),
                      bool(should_apply)))
    assert len(traced) == 1, "one trace serves every step"
    update_op, should_apply = traced[0]
    assert isinstance(update_op, tf.Operation)
    assert isinstance(should_apply, tf.Tensor)
    assert should_apply.dtype == tf.bool and should_apply.shape == ()
    return trace


def _tf1_graph_trace(config, steps):
    with tf.Graph().as_default():
        loss_scale = tf_lossscale.DynamicLossScale(**config)
        last = tf.compat.v1.placeholder(tf.float32, [2])
        update_op, should_apply = loss_scale.update(_grads(last))
        scale, good_steps = loss_scale(), loss_scale.good_steps
        assert isinstance(update_op, tf.Operation)
        assert isinstance(should_apply, tf.Tensor)
        assert should_apply.dtype == tf.bool and should_apply.shape == ()
        trace = []
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for finite in steps:
                feed = {last: [3.0, 1.0 if finite else _NAN]}
                _, applied = session.run([update_op, should_apply], feed)
                trace.append((float(session.run(scale)),
                              int(session.run(good_steps)), bool(applied)))
    return trace


_MODES = {
    "tf_function": _tf_function_trace,
    "xla": lambda config, steps: _tf_function_trace(config, steps, True),
    "tf1_graph": _tf1_graph_trace,
}


@pytest.mark.parametrize("scenario", _SCENARIOS.keys())
def test_eager_updates_follow_tf_reference(scenario):
    config, steps = _SCENARIOS[scenario]
    assert _eager_trace(config, steps) == _reference_trace(config, steps)


@pytest.mark.parametrize("scenario", _MODE_SCENARIOS)
@pytest.mark.parametrize("mode", _MODES.keys())
def test_graph_mode_updates_follow_tf_reference(mode, scenario):
    config, steps = _SCENARIOS[scenario]
    assert _MODES[mode](config, steps) == _reference_trace(config, steps)


def test_scale_never_becomes_inf():
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=_FLOAT32_MAX / 2, increment_period=1)
    for _ in range(3):
        loss_scale.update([tf.constant(1.0)])
        assert np.isfinite(loss_scale().numpy())
    # Doubling half the maximum lands exactly on it; doubling that would not.
    assert loss_scale().numpy() == np.float32(_FLOAT32_MAX)


def test_scale_never_drops_below_one():
    loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=2)
    for _ in range(4):
        loss_scale.update([tf.constant(_NAN)])
    assert loss_scale().numpy() == 1.0


def test_eager_update_changes_state_before_returning():
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=8, increment_period=1)
    before = loss_scale()
    update_op, should_apply = loss_scale.update([tf.constant(1.0)])
    assert update_op is None
    assert isinstance(should_apply, tf.Tensor)
    assert should_apply.dtype == tf.bool and should_apply.shape == ()
    assert bool(should_apply)
    assert loss_scale().numpy() == 16.0
    # A scale read earlier is a value, not a view of the variable.
    assert before.numpy() == 8.0


def test_eager_non_finite_update_asks_to_skip():
    loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=8)
    _, should_apply = loss_scale.update([tf.constant([1.0, _NAN])])
    assert not bool(should_apply)
    assert loss_scale().numpy() == 4.0


def test_call_returns_scalar_float32_tensor_not_variable():
    loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=64)
    scale = loss_scale()
    assert isinstance(scale, tf.Tensor)
    assert not isinstance(scale, tf.Variable)
    assert scale.dtype == tf.float32 and scale.shape == ()
    assert scale.numpy() == 64.0
    seen = []

    @tf.function
    def read():
        seen.append(loss_scale())
        return seen[-1]

    assert read().numpy() == 64.0
    assert isinstance(seen[0], tf.Tensor)
    assert not isinstance(seen[0], tf.Variable)
    assert seen[0].dtype == tf.float32 and seen[0].shape == ()


def test_defaults_match_tf_reference():
    config = tf_lossscale.DynamicLossScale().get_config()
    reference = tf.compat.v1.mixed_precision.DynamicLossScale().get_config()
    assert config == reference
    assert tf_lossscale.DynamicLossScale()().numpy() == (
        tf.compat.v1.mixed_precision.DynamicLossScale()().numpy())


@pytest.mark.parametrize("config", [
    dict(),
    dict(initial_loss_scale=8, increment_period=np.int64(5), multiplier=3),
    dict(initial_loss_scale=0.5, increment_period=1, multiplier=1.5),
    dict(initial_loss_scale=np.float32(2.0), increment_period=7,
         multiplier=np.float64(4)),
], ids=["defaults", "ints_and_numpy", "fractions", "numpy_floats"])
def test_get_config_has_exactly_three_plain_python_values(config):
    loss_scale = tf_lossscale.DynamicLossScale(**config)
    got = loss_scale.get_config()
    assert set(got) == {"initial_loss_scale", "increment_period", "multiplier"}
    # Exact types: numpy scalars here would not survive json.dumps.
    assert type(got["initial_loss_scale"]) is float  # pylint: disable=unidiomatic-typecheck
    assert type(got["increment_period"]) is int  # pylint: disable=unidiomatic-typecheck
    assert type(got["multiplier"]) is float  # pylint: disable=unidiomatic-typecheck
    reference = tf.compat.v1.mixed_precision.DynamicLossScale(**config)
    assert got == reference.get_config()


@pytest.mark.parametrize("config", [
    dict(),
    dict(initial_loss_scale=8, increment_period=5, multiplier=3),
    dict(initial_loss_scale=0.5, increment_period=1, multiplier=1.5),
], ids=["defaults", "custom", "fractions"])
def test_from_config_round_trips(config):
    original = tf_lossscale.DynamicLossScale(**config)
    restored = tf_lossscale.DynamicLossScale.from_config(original.get_config())
    assert isinstance(restored, tf_lossscale.DynamicLossScale)
    assert restored.get_config() == original.get_config()
    assert restored().numpy() == original().numpy()


def test_from_config_starts_from_initial_scale_not_current_state():
    original = tf_lossscale.DynamicLossScale(initial_loss_scale=8)
    original.update([tf.constant(_NAN)])
    restored = tf_lossscale.DynamicLossScale.from_config(original.get_config())
    assert restored().numpy() == 8.0
    assert int(restored.good_steps) == 0


@pytest.mark.parametrize("name", ["initial_loss_scale", "increment_period",
                                  "multiplier"])
def test_config_properties_are_read_only(name):
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=8, increment_period=5, multiplier=3)
    value = getattr(loss_scale, name)
    assert value == loss_scale.get_config()[name]
    assert type(value) is type(loss_scale.get_config()[name])  # pylint: disable=unidiomatic-typecheck
    with pytest.raises(AttributeError):
        setattr(loss_scale, name, value * 2)
    assert getattr(loss_scale, name) == value


def test_initial_loss_scale_property_keeps_initial_value_after_updates():
    loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=8)
    loss_scale.update([tf.constant(_NAN)])
    assert loss_scale.initial_loss_scale == 8.0
    assert loss_scale().numpy() == 4.0


def test_state_variables_are_named_typed_and_not_trainable():
    loss_scale = tf_lossscale.DynamicLossScale()
    by_name = {v.name.split(":")[0]: v for v in loss_scale.variables}
    assert set(by_name) == {"current_loss_scale", "good_steps"}
    assert by_name["current_loss_scale"].dtype == tf.float32
    assert by_name["good_steps"].dtype == tf.int64
    for variable in by_name.values():
        assert not variable.trainable
        assert variable.aggregation == tf.VariableAggregation.NONE
        assert variable.shape == ()


def test_state_variables_join_tf1_global_collection_and_initialise():
    with tf.Graph().as_default():
        loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=8)
        names = {v.op.name for v in tf.compat.v1.global_variables()}
        assert names == {"current_loss_scale", "good_steps"}
        assert not tf.compat.v1.trainable_variables()
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            assert session.run(loss_scale()) == 8.0
            assert session.run(loss_scale.good_steps) == 0


def test_is_trackable_under_the_variable_names():
    loss_scale = tf_lossscale.DynamicLossScale()
    children = tf.train.TrackableView(loss_scale).children(loss_scale)
    assert set(children) == {"current_loss_scale", "good_steps"}
    checkpoint = tf.train.Checkpoint(loss_scale=loss_scale)
    assert checkpoint.loss_scale is loss_scale


def test_instances_do_not_share_state():
    first = tf_lossscale.DynamicLossScale(initial_loss_scale=8)
    second = tf_lossscale.DynamicLossScale(initial_loss_scale=8)
    first.update([tf.constant(_NAN)])
    assert first().numpy() == 4.0
    assert second().numpy() == 8.0


def _state_in(text, name, value):
    return re.search(rf"\b{name}\b\W*{re.escape(repr(value))}", text)


def test_eager_repr_shows_configuration_and_current_state():
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=96, increment_period=7, multiplier=3)
    loss_scale.update([tf.constant(_NAN)])
    loss_scale.update([tf.constant(1.0)])
    loss_scale.update([tf.constant(1.0)])
    text = repr(loss_scale)
    assert text.startswith("DynamicLossScale(")
    assert _state_in(text, "initial_loss_scale", 96.0)
    assert _state_in(text, "increment_period", 7)
    assert _state_in(text, "multiplier", 3.0)
    assert _state_in(text, "current_loss_scale", float(loss_scale()))
    assert _state_in(text, "good_steps", 2)


def test_tf1_graph_repr_shows_configuration():
    with tf.Graph().as_default():
        loss_scale = tf_lossscale.DynamicLossScale(
            initial_loss_scale=96, increment_period=7, multiplier=3)
        text = repr(loss_scale)
    assert text.startswith("DynamicLossScale(")
    assert _state_in(text, "initial_loss_scale", 96.0)
    assert _state_in(text, "increment_period", 7)
    assert _state_in(text, "multiplier", 3.0)


# ---------------------------------------------------------------------------
# `_update_from_all_finite`: the update for optimizers that compute the
# all-replica finiteness flag themselves.


def test_update_from_all_finite_steps_like_update_eagerly():
    # pylint: disable=protected-access
    from_flag = tf_lossscale.DynamicLossScale(initial_loss_scale=8,
                                              increment_period=2)
    from_grads = tf_lossscale.DynamicLossScale(initial_loss_scale=8,
                                               increment_period=2)
    assert from_flag._needs_finiteness is True
    for finite in [T, T, F, T, F, F, T, T]:
        update_op, should_apply = from_flag._update_from_all_finite(
            tf.constant(finite))
        assert update_op is None
        assert bool(should_apply) is finite
        from_grads.update(_grads(_last_gradient(finite)))
        assert [v.numpy() for v in from_flag.variables] == [
            v.numpy() for v in from_grads.variables]


def test_update_from_all_finite_in_graph_orders_should_apply_after_the_update():
    loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=8,
                                               increment_period=1)
    seen = []

    @tf.function
    def step(all_finite):
        update_op, should_apply = loss_scale._update_from_all_finite(  # pylint: disable=protected-access
            all_finite)
        seen.append(update_op)
        # Reading the scale after should_apply sees the update.
        with tf.control_dependencies([should_apply]):
            return should_apply, loss_scale()

    should_apply, scale = step(tf.constant(True))
    assert isinstance(seen[0], tf.Operation)
    assert bool(should_apply) and float(scale) == 16.0
    should_apply, scale = step(tf.constant(False))
    assert not bool(should_apply) and float(scale) == 8.0


def test_update_from_all_finite_under_mirrored_cross_replica_context():
    strategy = training.mirrored(2)
    with strategy.scope():
        loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=8,
                                                   increment_period=1)

    @tf.function
    def step(all_finite):
        with strategy.scope():
            return loss_scale._update_from_all_finite(all_finite)[1]  # pylint: disable=protected-access

    assert bool(step(tf.constant(True)))
    assert not bool(step(tf.constant(False)))
    assert not bool(step(tf.constant(False)))
    copies = [c.numpy() for c in strategy.experimental_local_results(
        loss_scale.variables[0])]
    assert copies == [4.0, 4.0]

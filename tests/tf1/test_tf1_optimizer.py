"""`tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer`: TF1 optimizers
driven by a `tf_lossscale` loss scale, in graphs run by Sessions and eagerly.

Expected values are computed in the same run: by the wrapped optimizer alone,
by TensorFlow's own `MixedPrecisionLossScaleOptimizer`, or by the state
before the step. The seeded comparisons over random sequences are in
test_tf1_optimizer_parity.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import reference_oracle as oracle
from tests.helpers import training
from tests.helpers import subprocesses
from tests.helpers import tf1_graphs
import tf_lossscale
from tf_lossscale.compat.v1 import MixedPrecisionLossScaleOptimizer

TensorFlowWrapper = (
    tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer)



def _momentum():
    return tf.compat.v1.train.MomentumOptimizer(0.1, momentum=0.9)


def _ours(make_loss_scale=lambda: "dynamic", make_inner=_momentum):
    """A factory of our wrapper, for inside a graph: the loss scale's
    variables must be created there too."""
    return lambda: MixedPrecisionLossScaleOptimizer(make_inner(),
                                                    make_loss_scale())


_STEP_STATE = ("weights", "global_step", "inner_variables")
_assert_same_state = tf1_graphs.assert_same_state


# Construction.


def test_is_a_tf1_optimizer_named_after_the_wrapped_one():
    inner = tf.compat.v1.train.AdamOptimizer(name="MyAdam", use_locking=True)
    opt = MixedPrecisionLossScaleOptimizer(inner)
    assert isinstance(opt, tf.compat.v1.train.Optimizer)
    assert opt.get_name() == "MyAdam"
    assert opt._use_locking  # pylint: disable=protected-access
    assert isinstance(opt.loss_scale, tf_lossscale.DynamicLossScale)
    assert opt.loss_scale.get_config() == (
        tf_lossscale.DynamicLossScale().get_config())
    assert (tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer
            is MixedPrecisionLossScaleOptimizer)


def test_takes_the_loss_scale_tensorflows_wrapper_refuses():
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=64, hysteresis=2, min_loss_scale=0.5)
    with pytest.raises(ValueError, match="Could not interpret loss scale"):
        TensorFlowWrapper(_momentum(), loss_scale)
    assert MixedPrecisionLossScaleOptimizer(
        _momentum(), loss_scale).loss_scale is loss_scale


@pytest.mark.parametrize("identifier, expected", [
    ("dynamic", tf_lossscale.DynamicLossScale()),
    (128, tf_lossscale.FixedLossScale(128)),
    (tf_lossscale.FixedLossScale(1, skip_non_finite=True),
     tf_lossscale.FixedLossScale(1, skip_non_finite=True)),
    ({"class_name": "DynamicLossScale",
      "config": {"initial_loss_scale": 8, "increment_period": 3,
                 "multiplier": 4, "backoff_factor": 0.5}},
     tf_lossscale.DynamicLossScale(8, 3, 4, backoff_factor=0.5)),
])
def test_accepts_what_tf_lossscale_get_accepts(identifier, expected):
    opt = MixedPrecisionLossScaleOptimizer(_momentum(), identifier)
    assert type(opt.loss_scale) is type(expected)
    assert opt.loss_scale.get_config() == expected.get_config()


def test_uses_tensorflows_own_loss_scales_as_they_are():
    for loss_scale in (oracle.reference_dynamic(4, 2, 2),
                       oracle.reference_fixed(8)):
        opt = MixedPrecisionLossScaleOptimizer(_momentum(), loss_scale)
        assert opt.loss_scale is loss_scale


def test_refuses_none_non_optimizers_and_loss_scaling_optimizers():
    with pytest.raises(ValueError, match="cannot be None"):
        MixedPrecisionLossScaleOptimizer(_momentum(), None)
    with pytest.raises(ValueError, match="Could not interpret"):
        MixedPrecisionLossScaleOptimizer(_momentum(), "static")
    with pytest.raises(ValueError, match="tf.compat.v1.train.Optimizer"):
        MixedPrecisionLossScaleOptimizer(tf.keras.optimizers.SGD())
    for wrapped in (MixedPrecisionLossScaleOptimizer(_momentum()),
                    TensorFlowWrapper(_momentum(), "dynamic")):
        with pytest.raises(ValueError, match="scaled twice"):
            MixedPrecisionLossScaleOptimizer(wrapped)


# compute_gradients.


def test_compute_gradients_returns_the_wrapped_optimizers_gradients():
    """Same arguments as TF's; gradients of `loss * scale`, unscaled: equal
    to the plain optimizer's at a power-of-two scale. None and
    IndexedSlices gradients keep their form."""
    graph = tf.Graph()
    with graph.as_default():
        table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
        unused = tf.Variable(1.0)
        ids = tf.constant([1, 4, 4])
        weights = tf.constant([[0.5, -2.0]])
        loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) * weights)
        grad_loss = tf.constant(3.0)
        kwargs = dict(var_list=[table, unused], grad_loss=grad_loss,
                      gate_gradients=tf.compat.v1.train.Optimizer.GATE_GRAPH,
                      aggregation_method=None,
                      colocate_gradients_with_ops=True)
        opt = MixedPrecisionLossScaleOptimizer(
            _momentum(), tf_lossscale.DynamicLossScale(2.0**12))
        ours = opt.compute_gradients(loss, **kwargs)
        plain = _momentum().compute_gradients(loss, **kwargs)
        assert [v for _, v in ours] == [table, unused]
        assert ours[1][0] is None
        assert isinstance(ours[0][0], tf.IndexedSlices)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            got, want = session.run([ours[0][0], plain[0][0]])
    np.testing.assert_array_equal(got.values, want.values)
    np.testing.assert_array_equal(got.indices, want.indices)
    # The scale did reach the loss: 3 * 0.5 and 3 * -2 per looked-up row.
    np.testing.assert_array_equal(got.values, [[1.5, -6.0]] * 3)


def test_compute_gradients_scales_the_loss_it_differentiates():
    graph = tf.Graph()
    with graph.as_default():
        variable = tf.Variable(1.0)
        seen = []

        class Recording(tf.compat.v1.train.GradientDescentOptimizer):

            def compute_gradients(self, loss, *args, **kwargs):
                seen.append(loss)
                return super().compute_gradients(loss, *args, **kwargs)

        opt = MixedPrecisionLossScaleOptimizer(
            Recording(1.0), tf_lossscale.FixedLossScale(1024))
        opt.compute_gradients(variable * 2.0)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            assert session.run(seen[0]) == 2048.0


def test_float16_gradients_are_unscaled_where_tensorflows_wrapper_fails():
    graph = tf.Graph()
    with graph.as_default():
        variable = tf.compat.v1.Variable(tf.constant([1.0, -3.0], tf.float16))
        loss = tf.reduce_sum(variable * variable)
        with pytest.raises(TypeError, match="float16"):
            TensorFlowWrapper(_momentum(), "dynamic").compute_gradients(loss)
        # At 2**15, 2 * 2**15 would overflow float16 itself.
        (grad, _), = MixedPrecisionLossScaleOptimizer(
            _momentum(), tf_lossscale.DynamicLossScale(2.0**10)
        ).compute_gradients(loss)
        (plain, _), = _momentum().compute_gradients(loss)
        assert grad.dtype == tf.float16
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            got, want = session.run([grad, plain])
    np.testing.assert_array_equal(got, want)


# apply_gradients and minimize in a Session.


def test_a_nan_feed_leaves_weights_slots_and_global_step_and_backs_off():
    train = tf1_graphs.TrainGraph(_ours(lambda: tf_lossscale.DynamicLossScale(
        initial_loss_scale=2.0**10, increment_period=2)))
    assert isinstance(train.train_op, tf.Operation)
    before, skipped, inf, applied = tf1_graphs.run_steps(
        train, ["finite", "nan", "inf", "finite"])
    _assert_same_state(skipped, before, _STEP_STATE)
    _assert_same_state(inf, before, _STEP_STATE)
    assert (skipped["scale"], inf["scale"]) == (2.0**9, 2.0**8)
    assert applied["global_step"] == 2
    assert not np.array_equal(applied["weights"][0], before["weights"][0])
    assert applied["scale"] == 2.0**8


def test_the_step_is_one_operation_named_like_tensorflows():
    graph = tf.Graph()
    with graph.as_default():
        variable = tf.Variable(1.0)
        opt = _ours()()
        grads_and_vars = opt.compute_gradients(variable * 3.0)
        named = opt.apply_gradients(grads_and_vars, name="train")
        default = opt.apply_gradients(grads_and_vars)
    assert isinstance(named, tf.Operation) and named.name == "train"
    assert isinstance(default, tf.Operation)
    assert default.name == "Momentum"


def test_growth_and_rule_arguments_drive_the_step():
    """A `tf_lossscale` rule TF cannot express (hysteresis, floor) runs."""
    train = tf1_graphs.TrainGraph(_ours(lambda: tf_lossscale.DynamicLossScale(
        initial_loss_scale=4, increment_period=1, hysteresis=2,
        min_loss_scale=2)))
    scales = [state["scale"] for state in tf1_graphs.run_steps(
        train, ["finite", "nan", "nan", "nan", "nan", "finite"])]
    assert scales == [8, 8, 4, 2, 2, 4]


def test_a_fixed_scale_applies_every_step_unless_it_skips_non_finite():
    applies_all = tf1_graphs.TrainGraph(_ours(lambda: 16))
    states = tf1_graphs.run_steps(applies_all, ["finite", "nan"])
    assert states[1]["global_step"] == 2
    assert np.isnan(states[1]["weights"][0]).any()
    skips = tf1_graphs.TrainGraph(_ours(
        lambda: tf_lossscale.FixedLossScale(16, skip_non_finite=True)))
    before, after = tf1_graphs.run_steps(skips, ["finite", "nan"])
    _assert_same_state(after, before, _STEP_STATE)


def test_drives_tensorflows_own_dynamic_loss_scale_like_tensorflows_wrapper():
    kinds = ["finite", "large", "nan", "finite", "finite", "-inf", "finite"]
    ours = tf1_graphs.run_steps(tf1_graphs.TrainGraph(
        _ours(lambda: oracle.reference_dynamic(2.0**14, 2, 2))), kinds)
    theirs = tf1_graphs.run_steps(tf1_graphs.TrainGraph(
        lambda: TensorFlowWrapper(_momentum(), oracle.reference_dynamic(
            2.0**14, 2, 2))), kinds)
    for a, e in zip(ours, theirs):
        _assert_same_state(a, e)


def test_slots_are_the_inner_optimizers_and_variables_add_the_scales():
    """As TensorFlow's wrapper: the wrapper itself reports no slots (a slot
    reported by two optimizers breaks tf.train.Checkpoint); `variables()`
    is the inner optimizer's, then the loss scale's."""
    train = tf1_graphs.TrainGraph(_ours(make_inner=tf1_graphs.adam))
    opt, inner = train.optimizer, train.optimizer.inner_optimizer
    assert inner is opt._optimizer  # pylint: disable=protected-access
    assert inner.get_slot_names() == ["m", "v"]
    assert opt.get_slot_names() == []
    assert opt.get_slot(train.kernel, "m") is None
    with train.graph.as_default():
        assert [id(v) for v in opt.variables()] == [
            id(v) for v in inner.variables() + list(opt.loss_scale.variables)]
    reference = tf1_graphs.TrainGraph(
        lambda: TensorFlowWrapper(tf1_graphs.adam(), "dynamic"))
    with reference.graph.as_default():
        reference_names = [v.name for v in reference.optimizer.variables()]
    with train.graph.as_default():
        assert [v.name for v in opt.variables()] == reference_names
    assert reference.optimizer.get_slot_names() == opt.get_slot_names()
    assert reference.optimizer.get_slot(reference.kernel, "m") is None


# Saving, MonitoredTrainingSession.


def test_saver_saves_and_restores_the_scale_and_the_slots(tmp_path):
    make = _ours(lambda: tf_lossscale.DynamicLossScale(2.0**10, 3),
                 tf1_graphs.adam)
    path = str(tmp_path / "ckpt")
    saved = tf1_graphs.run_steps(tf1_graphs.TrainGraph(make),
                                 ["finite", "nan", "finite"],
                                 checkpoint=path)[-1]
    assert saved["scale"] == 2.0**9
    assert saved["global_step"] == 2
    _assert_same_state(tf1_graphs.restored_state(make, path), saved)


def test_saver_restores_a_checkpoint_of_tensorflows_wrapper(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = tf1_graphs.run_steps(
        tf1_graphs.TrainGraph(
            lambda: TensorFlowWrapper(tf1_graphs.adam(), "dynamic")),
        ["large", "finite", "nan"], checkpoint=path)[-1]
    restored = tf1_graphs.restored_state(_ours(make_inner=tf1_graphs.adam),
                                         path)
    _assert_same_state(restored, saved)


def test_object_checkpoint_of_tensorflows_wrapper_restores_into_ours(
        tmp_path):
    """tf.train.Checkpoint, eagerly: the same object names (`base_optimizer`,
    `loss_scale`, and the scale's variables) as TensorFlow's wrapper."""

    def train(optimizer, steps):
        variable = tf.Variable([1.0, 2.0])
        for value in steps:
            optimizer.minimize(lambda: tf.reduce_sum(variable * value),  # pylint: disable=cell-var-from-loop
                               var_list=[variable])
        return variable

    theirs = TensorFlowWrapper(_momentum(),
                               oracle.reference_dynamic(2.0**8, 3))
    saved_variable = train(theirs, [1.0, np.nan, 2.0])
    path = tf.train.Checkpoint(variable=saved_variable, optimizer=theirs).save(
        str(tmp_path / "ckpt"))
    ours = MixedPrecisionLossScaleOptimizer(
        _momentum(), tf_lossscale.DynamicLossScale(2.0**8, 3))
    variable = train(ours, [])
    ours.minimize(lambda: tf.reduce_sum(variable * 0.0), var_list=[variable])
    checkpoint = tf.train.Checkpoint(variable=variable, optimizer=ours)
    checkpoint.restore(path).assert_consumed()
    checkpoint.save(str(tmp_path / "ours"))  # And ours saves.
    assert float(ours.loss_scale()) == float(theirs._loss_scale()) == 2.0**7  # pylint: disable=protected-access
    assert int(ours.loss_scale.good_steps) == 1
    np.testing.assert_array_equal(variable.numpy(), saved_variable.numpy())
    np.testing.assert_array_equal(
        ours.inner_optimizer.get_slot(variable, "momentum").numpy(),
        theirs._optimizer.get_slot(saved_variable, "momentum").numpy())  # pylint: disable=protected-access


def test_a_failure_policy_fails_the_session_run():
    train = tf1_graphs.TrainGraph(_ours(lambda: tf_lossscale.DynamicLossScale(
        1.0, on_min_loss_scale="raise")))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="already at min_loss_scale"):
        tf1_graphs.run_steps(train, ["finite", "nan"])


def test_monitored_training_session_runs_it(tmp_path):
    graph = tf.Graph()
    with graph.as_default():
        global_step = tf.compat.v1.train.get_or_create_global_step()
        variable = tf.Variable(1.0)
        value = tf.compat.v1.placeholder(tf.float32, [])
        opt = _ours(lambda: tf_lossscale.DynamicLossScale(2.0**8))()
        train_op = opt.minimize(variable * value, global_step=global_step)
        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=3)]
        feeds = iter([1.0, np.nan, 1.0, np.inf, 1.0, 1.0, 1.0])
        runs = 0
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=str(tmp_path), hooks=hooks,
                save_checkpoint_steps=1) as session:
            while not session.should_stop():
                session.run(train_op, {value: next(feeds)})
                runs += 1
        # Three applied steps stop it; the two skipped ones did not count.
        assert runs == 5
        reader = tf.train.load_checkpoint(str(tmp_path))
        assert reader.get_tensor("global_step") == 3
        assert reader.get_tensor("current_loss_scale") == 2.0**6
        np.testing.assert_allclose(reader.get_tensor("Variable"),
                                   1.0 - 0.1 * (1 + 1.9 + 2.71))


# Eager.


def test_eager_minimize_takes_a_callable_and_skips_non_finite_steps():
    variable = tf.Variable([1.0, 2.0])
    data = tf.Variable([1.0, 1.0])
    opt = MixedPrecisionLossScaleOptimizer(
        _momentum(), tf_lossscale.DynamicLossScale(8))
    global_step = tf.Variable(0, dtype=tf.int64)
    for values in ([1.0, 1.0], [np.nan, 1.0], [1.0, 1.0]):
        data.assign(values)
        assert opt.minimize(lambda: tf.reduce_sum(variable * data),
                            var_list=[variable],
                            global_step=global_step) is None
    assert int(global_step) == 2
    assert float(opt.loss_scale()) == 4.0
    np.testing.assert_allclose(variable.numpy(), [0.71, 1.71])
    np.testing.assert_allclose(
        opt.inner_optimizer.get_slot(variable, "momentum").numpy(), [1.9, 1.9])


# Distribution.


def _mirrored_train(make_optimizer, strategy):
    """A model trained under `strategy`; replica i reads inputs[i]."""
    graph = tf.Graph()
    with graph.as_default(), strategy.scope():
        kernel, bias = tf1_graphs.initial_values()
        kernel, bias = tf.Variable(kernel), tf.Variable(bias)
        inputs = tf.compat.v1.placeholder(
            tf.float32, (strategy.num_replicas_in_sync,)
            + tf1_graphs.INPUT_SHAPE)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = make_optimizer()

        def step():
            replica = tf.distribute.get_replica_context()
            loss = tf1_graphs.model_loss(
                kernel, bias, inputs[replica.replica_id_in_sync_group])
            return opt.minimize(loss, global_step=global_step)

        train_op = strategy.group(strategy.run(step))
        state = [kernel, bias, global_step, opt._loss_scale()]  # pylint: disable=protected-access
        init = tf.compat.v1.global_variables_initializer()
    return graph, inputs, train_op, state, init


@pytest.mark.parametrize("nan_replica", [0, 1])
def test_mirrored_nan_on_one_replica_skips_on_all_like_tensorflows(
        nan_replica):
    """Under MirroredStrategy in a TF1 graph: the same weights, step and
    scale as TensorFlow's wrapper with its own loss scale."""
    results = []
    for make in (_ours(lambda: tf_lossscale.DynamicLossScale(2.0**10, 2)),
                 lambda: TensorFlowWrapper(
                     _momentum(), oracle.reference_dynamic(2.0**10, 2))):
        graph, inputs, train_op, state, init = _mirrored_train(
            make, training.mirrored(2))
        rng = np.random.default_rng(7)
        batches = [np.stack([tf1_graphs.feed("finite", rng)
                             for _ in range(2)]) for _ in range(4)]
        batches[1][nan_replica, 0, 0] = np.nan
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(init)
            history = []
            for batch in batches:
                session.run(train_op, {inputs: batch})
                history.append(session.run(state))
        results.append(history)
    ours, theirs = results
    before, skipped = ours[0], ours[1]
    np.testing.assert_array_equal(skipped[0], before[0])
    assert skipped[2] == 1 and skipped[3] == 2.0**9
    for a, e in zip(ours, theirs):
        for a_value, e_value in zip(a, e):
            np.testing.assert_array_equal(a_value, e_value)


def test_apply_gradients_in_cross_replica_context_raises():
    graph = tf.Graph()
    with graph.as_default(), training.mirrored(2).scope():
        variable = tf.Variable(1.0)
        opt = _ours()()
        with pytest.raises(ValueError, match="replica context"):
            opt.apply_gradients([(tf.constant(1.0), variable)])


# TF1 behaviour (tf.compat.v1.disable_v2_behavior), as TF1 programs run.


def test_runs_with_v2_behaviour_disabled():
    """Reference variables and TF1 control flow, in a process of its own:
    skips, back-off and Saver as above, and the same weights as TensorFlow's
    wrapper."""
    result = subprocesses.run_script("tf1_behaviour_worker.py", timeout=300,
                                     TF_CPP_MIN_LOG_LEVEL="3")
    assert result["variable_type"] == "RefVariable"
    assert result["scales"] == [2.0**10, 2.0**9, 2.0**8, 2.0**8, 2.0**9]
    assert result["global_steps"] == [1, 1, 1, 2, 3]
    assert result["ours_weights"] == result["tensorflows_weights"]
    assert result["restored"] == result["saved"]

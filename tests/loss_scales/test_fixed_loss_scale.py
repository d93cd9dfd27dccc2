"""Behaviour of `FixedLossScale` and of the abstract `LossScale` base."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
from tests.helpers import models
from tests.helpers import reference_oracle as oracle
import tf_lossscale

_NAN = float("nan")
_INF = float("inf")
_FLOAT32_MAX = float(np.finfo(np.float32).max)

# Values a user may pick, including ones float32 cannot hold exactly (1.1)
# and the largest one allowed.
_VALUES = [1, 128, 2.5, 1.1, 2**15, _FLOAT32_MAX]

# Gradients a fixed scale must ignore, finite or not.
_GRADIENTS = {
    "finite": lambda: [tf.constant([1.0, 2.0])],
    "nan": lambda: [tf.constant([1.0, _NAN])],
    "inf": lambda: {"w": tf.constant([_INF]), "b": None},
    "none": lambda: None,
}


def _reference(value):
    return tf.compat.v1.mixed_precision.FixedLossScale(value)


def test_loss_scale_base_class_cannot_be_instantiated():
    with pytest.raises(TypeError):
        tf_lossscale.LossScale()


def test_subclass_missing_update_cannot_be_instantiated():

    class WithoutUpdate(tf_lossscale.LossScale):

        def __call__(self):
            return tf.constant(1.0)

        def get_config(self):
            return {}

    with pytest.raises(TypeError):
        WithoutUpdate()


@pytest.mark.parametrize("value", _VALUES, ids=repr)
def test_call_returns_scalar_float32_tensor_matching_tf_reference(value):
    scale = tf_lossscale.FixedLossScale(value)()
    assert isinstance(scale, tf.Tensor)
    assert not isinstance(scale, tf.Variable)
    assert scale.dtype == tf.float32
    assert scale.shape == ()
    assert scale.numpy() == np.float32(value)
    assert scale.numpy() == _reference(value)().numpy()


def test_call_inside_tf_function_returns_symbolic_float32_tensor():
    loss_scale = tf_lossscale.FixedLossScale(64)
    seen = []

    @tf.function
    def scaled_loss(loss):
        scale = loss_scale()
        seen.append(scale)
        return loss * scale

    assert scaled_loss(tf.constant(0.5)).numpy() == 32.0
    assert isinstance(seen[0], tf.Tensor)
    assert not isinstance(seen[0], tf.Variable)
    assert seen[0].dtype == tf.float32 and seen[0].shape == ()


@pytest.mark.parametrize("grads", _GRADIENTS.values(), ids=_GRADIENTS.keys())
def test_eager_update_returns_none_and_python_true(grads):
    loss_scale = tf_lossscale.FixedLossScale(8)
    update_op, should_apply = loss_scale.update(grads())
    assert update_op is None
    # A Python bool, so callers may branch on it without a tensor.
    assert should_apply is True
    assert loss_scale().numpy() == 8.0


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("grads", _GRADIENTS.values(), ids=_GRADIENTS.keys())
def test_update_in_tf_function_returns_operation_and_python_true(
        grads, jit_compile):
    loss_scale = tf_lossscale.FixedLossScale(8)
    seen = []

    @tf.function(jit_compile=jit_compile)
    def step():
        update_op, should_apply = loss_scale.update(grads())
        seen.append((update_op, should_apply))
        return loss_scale()

    assert step().numpy() == 8.0
    update_op, should_apply = seen[0]
    assert isinstance(update_op, tf.Operation)
    assert should_apply is True


@pytest.mark.parametrize("grads", _GRADIENTS.values(), ids=_GRADIENTS.keys())
def test_update_in_tf1_graph_returns_runnable_operation_and_python_true(grads):
    with tf.Graph().as_default():
        loss_scale = tf_lossscale.FixedLossScale(8)
        update_op, should_apply = loss_scale.update(grads())
        scale = loss_scale()
        assert isinstance(update_op, tf.Operation)
        assert should_apply is True
        assert isinstance(scale, tf.Tensor) and scale.dtype == tf.float32
        with tf.compat.v1.Session() as session:
            for _ in range(3):
                session.run(update_op)
                assert session.run(scale) == 8.0


def test_scale_never_changes_whatever_the_gradients():
    loss_scale = tf_lossscale.FixedLossScale(3)
    for _ in range(3):
        for grads in _GRADIENTS.values():
            loss_scale.update(grads())
            assert loss_scale().numpy() == 3.0


def test_holds_no_state_variables():
    created = []

    def counting_creator(next_creator, **kwargs):
        created.append(kwargs.get("name"))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(counting_creator):
        loss_scale = tf_lossscale.FixedLossScale(5)
        loss_scale.update([tf.constant([_NAN])])
    assert not created
    assert loss_scale.variables == ()


@pytest.mark.parametrize("value", [1, 128, 2.5, _FLOAT32_MAX], ids=repr)
def test_get_config_holds_value_as_float(value):
    config = tf_lossscale.FixedLossScale(value).get_config()
    assert config == {"loss_scale_value": float(value)}
    assert type(config["loss_scale_value"]) is float  # pylint: disable=unidiomatic-typecheck
    # The same keys as TF's reference, so configs move between them.
    assert set(config) == set(_reference(value).get_config())


def test_get_config_of_numpy_value_is_plain_float():
    config = tf_lossscale.FixedLossScale(np.float32(16)).get_config()
    assert type(config["loss_scale_value"]) is float  # pylint: disable=unidiomatic-typecheck
    assert config["loss_scale_value"] == 16.0


@pytest.mark.parametrize("value", [1, 2.5, 1.1, 2**15], ids=repr)
def test_from_config_round_trips(value):
    original = tf_lossscale.FixedLossScale(value)
    restored = tf_lossscale.FixedLossScale.from_config(original.get_config())
    assert isinstance(restored, tf_lossscale.FixedLossScale)
    assert restored.get_config() == original.get_config()
    assert restored().numpy() == original().numpy()


def test_loss_scale_value_property_is_read_only():
    loss_scale = tf_lossscale.FixedLossScale(4)
    assert loss_scale.loss_scale_value == 4.0
    with pytest.raises(AttributeError):
        loss_scale.loss_scale_value = 8.0
    assert loss_scale().numpy() == 4.0


@pytest.mark.parametrize("value", [1, 2.5, 1.1, 32768], ids=repr)
def test_repr_shows_value(value):
    text = repr(tf_lossscale.FixedLossScale(value))
    assert text.startswith("FixedLossScale(")
    assert repr(float(value)) in text


def test_is_trackable_by_checkpoints():
    loss_scale = tf_lossscale.FixedLossScale(4)
    # Checkpoint refuses attributes that are not trackable.
    checkpoint = tf.train.Checkpoint(loss_scale=loss_scale)
    assert checkpoint.loss_scale is loss_scale



# ---------------------------------------------------------------------------
# skip_non_finite=True: a finite check without scaling (mixed_bfloat16).


def _skipping(value=1):
    return tf_lossscale.FixedLossScale(value, skip_non_finite=True)


_FINITE = {"finite": True, "nan": False, "inf": False, "none": True}


@pytest.mark.parametrize("grads", _GRADIENTS.keys())
def test_skip_non_finite_asks_to_skip_exactly_the_non_finite_steps(grads):
    loss_scale = _skipping(8)
    update_op, should_apply = loss_scale.update(_GRADIENTS[grads]())
    assert update_op is None
    assert bool(should_apply) is _FINITE[grads]
    assert loss_scale().numpy() == 8.0


@pytest.mark.parametrize("mode", ["tf_function", "tf1_graph"])
def test_skip_non_finite_in_graphs_returns_op_and_bool_tensor(mode):
    values = [[1.0, 2.0], [1.0, _NAN], [_INF, 0.0], [3.0, 4.0]]
    if mode == "tf_function":
        loss_scale = _skipping(4)
        seen = []

        @tf.function
        def step(grad):
            update_op, should_apply = loss_scale.update([grad])
            seen.append(update_op)
            return should_apply

        flags = [bool(step(tf.constant(v))) for v in values]
        assert isinstance(seen[0], tf.Operation)
    else:
        with tf.Graph().as_default():
            loss_scale = _skipping(4)
            grad = tf.compat.v1.placeholder(tf.float32, [2])
            update_op, should_apply = loss_scale.update([grad])
            assert isinstance(update_op, tf.Operation)
            with tf.compat.v1.Session() as session:
                flags = [bool(session.run(should_apply, {grad: v}))
                         for v in values]
    assert flags == [True, False, False, True]
    assert loss_scale.variables == ()


def test_skip_non_finite_is_keyword_only_and_a_bool():
    with pytest.raises(TypeError):
        tf_lossscale.FixedLossScale(1, True)  # pylint: disable=too-many-function-args
    for value in [1, 0, None, "True", np.float32(1)]:
        with pytest.raises(TypeError, match="skip_non_finite"):
            tf_lossscale.FixedLossScale(1, skip_non_finite=value)
    assert _skipping().skip_non_finite is True
    assert tf_lossscale.FixedLossScale(
        1, skip_non_finite=np.bool_(True)).skip_non_finite is True
    assert tf_lossscale.FixedLossScale(1).skip_non_finite is False


def test_skip_non_finite_appears_in_config_only_when_true():
    assert tf_lossscale.FixedLossScale(2).get_config() == {
        "loss_scale_value": 2.0}
    assert tf_lossscale.FixedLossScale(
        2, skip_non_finite=False).get_config() == {"loss_scale_value": 2.0}
    config = _skipping(2).get_config()
    assert config == {"loss_scale_value": 2.0, "skip_non_finite": True}
    restored = tf_lossscale.FixedLossScale.from_config(config)
    assert restored.skip_non_finite is True
    assert repr(restored) == "FixedLossScale(2.0, skip_non_finite=True)"


@pytest.mark.parametrize("skip", [False, True])
def test_update_from_all_finite_and_needs_finiteness(skip):
    loss_scale = tf_lossscale.FixedLossScale(4, skip_non_finite=skip)
    # pylint: disable=protected-access
    assert loss_scale._needs_finiteness is skip
    for all_finite in (True, False):
        update_op, should_apply = loss_scale._update_from_all_finite(
            tf.constant(all_finite))
        assert update_op is None
        assert bool(should_apply) is (all_finite or not skip)
    if not skip:
        assert loss_scale._update_from_all_finite(tf.constant(False))[1] is True

    @tf.function
    def graph_update(all_finite):
        update_op, should_apply = loss_scale._update_from_all_finite(
            all_finite)
        assert isinstance(update_op, tf.Operation)
        return tf.convert_to_tensor(should_apply)

    assert bool(graph_update(tf.constant(False))) is not skip


def test_skip_non_finite_agrees_across_mirrored_replicas():
    strategy = training.mirrored(2)
    loss_scale = _skipping()

    @tf.function
    def step(poison):
        def replica_fn():
            replica = tf.distribute.get_replica_context(
            ).replica_id_in_sync_group
            grad = tf.fill([2], 1.0) + tf.where(replica == 1, poison, 0.0)
            return tf.identity(loss_scale.update([grad])[1])
        return strategy.run(replica_fn)

    for poison, expected in [(0.0, True), (_NAN, False), (0.0, True)]:
        flags = strategy.experimental_local_results(step(tf.constant(poison)))
        assert [bool(f) for f in flags] == [expected, expected]


@pytest.mark.usefixtures("keras_isolation")
def test_bfloat16_fit_skips_a_nan_batch_and_keeps_weights_bit_identical():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = models.tiny_model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), loss_scale=_skipping())
    model.compile(optimizer, "mse")
    assert model.optimizer is optimizer
    x, y = training.normal_data(8)
    model.fit(x, y, batch_size=8, verbose=0)
    state = model.weights + optimizer.inner_optimizer.variables
    before = [v.numpy() for v in state]
    x[2, 1] = _NAN
    model.fit(x, y, batch_size=8, verbose=0)
    for variable, value in zip(state, before):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert int(optimizer.skipped_steps) == 1
    assert int(optimizer.iterations.numpy()) == 1
    assert float(optimizer.loss_scale()) == 1.0


# ---------------------------------------------------------------------------
# Against TensorFlow's reference, tf.compat.v1.mixed_precision.FixedLossScale:
# the same float32 value, and never a skip.

FIXED_VALUES = [1, 1.5, 3.3, 7, 2**15, 2**24 + 1, 1e30, oracle.FLOAT32_MAX]


@pytest.mark.parametrize("value", FIXED_VALUES)
def test_fixed_scale_value_matches_reference(value):
    ours = tf_lossscale.FixedLossScale(value)()
    reference = oracle.reference_fixed(value)()
    assert ours.dtype == reference.dtype == tf.float32
    assert ours.shape == reference.shape == ()
    oracle.assert_same_float32_bits(ours.numpy(), reference.numpy(), value)


def _non_finite_grads():
    return [tf.constant([1.0, np.nan]), None,
            tf.IndexedSlices(tf.constant([[np.inf]], tf.float16),
                             tf.constant([0]), tf.constant([2, 1]))]


@pytest.mark.parametrize("value", [1, 3.3, oracle.FLOAT32_MAX])
def test_fixed_scale_always_applies_and_never_changes_eagerly(value):
    ours = tf_lossscale.FixedLossScale(value)
    reference = oracle.reference_fixed(value)
    for grads in ([tf.constant(2.0)], _non_finite_grads()):
        for loss_scale in (ours, reference):
            _, should_apply = loss_scale.update(grads)
            assert should_apply is True
        oracle.assert_same_float32_bits(ours().numpy(),
                                        reference().numpy(), value)


def test_fixed_scale_decision_is_python_true_inside_tf_function():
    # A Python True lets callers drop the skip branch at trace time.
    decisions = []
    ours = tf_lossscale.FixedLossScale(128)
    reference = oracle.reference_fixed(128)

    @tf.function
    def step(values):
        grads = [values, None]
        for loss_scale in (ours, reference):
            decisions.append(loss_scale.update(grads)[1])
        return ours(), reference()

    ours_scale, reference_scale = step(tf.constant([np.nan, 1.0]))
    assert len(decisions) == 2
    assert all(decision is True for decision in decisions), decisions
    oracle.assert_same_float32_bits(ours_scale.numpy(),
                                    reference_scale.numpy())

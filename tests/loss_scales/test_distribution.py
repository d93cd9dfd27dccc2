"""DynamicLossScale under tf.distribute strategies within one process.

Every replica computes gradients on its own part of the batch, so a NaN or Inf
can show up on some replicas only. These tests pin down that all replicas
nevertheless reach one decision per step, that the shared scale follows the
single-device algorithm exactly (TensorFlow's reference
`tf.compat.v1.mixed_precision.DynamicLossScale` is the oracle), and that every
replica's copy of the scale stays identical.

The strategies run over the logical CPU devices that conftest.py creates.
Eager MirroredStrategy is slow, so eager sequences are short; long sequences
run in one `tf.function` loop.
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
import tf_lossscale

NAN = float("nan")
INF = float("inf")
NON_FINITE_KINDS = {"nan": NAN, "+inf": INF, "-inf": -INF}

# Small numbers so a few hundred steps visit the floor of 1, back-offs and
# repeated growth.
INITIAL_SCALE = 8.0
INCREMENT_PERIOD = 3
MULTIPLIER = 2.0

LONG_SEQUENCE_MIN_STEPS = 240
SHORT_SEQUENCE = "short"
LONG_SEQUENCE = "long"

STRATEGIES = {
    "default": tf.distribute.get_strategy,
    "one_device": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
    "mirrored_2": lambda: training.mirrored(2),
    "mirrored_4": lambda: training.mirrored(4),
}
MULTI_REPLICA_STRATEGIES = ("mirrored_2", "mirrored_4")
CONTEXTS = ("replica", "cross_replica")


def make_loss_scale():
    return tf_lossscale.DynamicLossScale(
        INITIAL_SCALE, INCREMENT_PERIOD, MULTIPLIER)


def make_reference_loss_scale():
    return tf.compat.v1.mixed_precision.DynamicLossScale(
        INITIAL_SCALE, INCREMENT_PERIOD, MULTIPLIER)


def scale_variable(loss_scale):
    variable, = [v for v in loss_scale.variables
                 if "current_loss_scale" in v.name]
    return variable


# ---------------------------------------------------------------------------
# Schedules: poison[step, replica] is added to one gradient of that replica in
# that step; 0 keeps it finite.


def schedule(rows):
    return np.array(rows, dtype=np.float32)


def long_schedule(num_replicas, seed=0):
    """Hundreds of steps: every non-finite kind on every non-empty subset of
    replicas, replicas mixing different kinds, and finite runs of random length
    in between (long enough to grow the scale, short enough to hit the
    floor)."""
    rng = np.random.RandomState(seed)
    subsets = [s for size in range(1, num_replicas + 1)
               for s in itertools.combinations(range(num_replicas), size)]
    rows = []
    while len(rows) < LONG_SEQUENCE_MIN_STEPS:
        for subset, kind in itertools.product(
                subsets, NON_FINITE_KINDS.values()):
            rows.extend([[0.0] * num_replicas] * rng.randint(0, 8))
            row = [0.0] * num_replicas
            for replica in subset:
                row[replica] = kind
            rows.append(row)
        kinds = [0.0] + list(NON_FINITE_KINDS.values())
        for _ in range(10):
            rows.append([kinds[i] for i in
                         rng.choice(4, num_replicas, p=[.7, .1, .1, .1])])
    return schedule(rows)


def short_schedule(num_replicas, poisoned_replicas=(-1,), kind=NAN):
    """Growth, one poisoned step, recovery and a second poisoned step."""
    finite = [0.0] * num_replicas
    poisoned = list(finite)
    for replica in poisoned_replicas:
        poisoned[replica] = kind
    return schedule([finite, finite, finite, poisoned, finite, poisoned])


def gradients_for(poison, step, replica):
    """One replica's gradients: dense float32 and float16, a None and a dict.

    Which gradient carries the poison rotates with the step, so a check that
    only looks at some gradients is caught.
    """
    bad = poison[step, replica]
    target = step % 3
    base = tf.cast(replica + 1, tf.float32)
    return [
        tf.fill([3], base) + tf.where(target == 0, bad, 0.0),
        None,
        tf.cast(tf.fill([2, 2], base / 2) + tf.where(target == 1, bad, 0.0),
                tf.float16),
        {"bias": tf.fill([1], -base) + tf.where(target == 2, bad, 0.0)},
    ]


def replica_gradients(poison, step):
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return gradients_for(poison, step, replica)


# ---------------------------------------------------------------------------
# Running a schedule.


def _stack_local(strategy, value):
    return tf.stack([tf.convert_to_tensor(v) for v in
                     strategy.experimental_local_results(value)])


def observe(strategy, loss_scale, poison, context, in_function):
    """Runs every step of `poison` and returns what each step left behind.

    Returns a dict of numpy arrays, one row per step:
      scale: the scale read in cross-replica context after the step;
      should_apply: the decision as received by each replica (one column per
        replica in replica context; the single cross-replica value otherwise);
      replica_reads: the scale as read inside `strategy.run` by each replica;
      variable_copies: every local copy of the scale variable.
    """
    poison = tf.constant(poison)
    num_steps = poison.shape[0]
    if isinstance(loss_scale, tf_lossscale.LossScale):
        variable = scale_variable(loss_scale)
    else:
        # TensorFlow's reference has no public handle on its variable.
        # pylint: disable-next=protected-access
        variable = loss_scale._current_loss_scale

    def update_in_replica(step):
        _, should_apply = loss_scale.update(replica_gradients(poison, step))
        # tf.identity gives each replica its own output, so the result shows
        # what every replica received, not one shared tensor.
        return tf.identity(should_apply), tf.identity(loss_scale())

    def one_step(step):
        if context == "replica":
            should_apply, reads = strategy.run(update_in_replica, args=(step,))
        else:
            grads = strategy.run(replica_gradients, args=(poison, step))
            update_op, should_apply = loss_scale.update(grads)
            if tf.executing_eagerly() and isinstance(
                    loss_scale, tf_lossscale.LossScale):
                assert update_op is None
            reads = strategy.run(lambda: tf.identity(loss_scale()))
        return {
            "scale": loss_scale(),
            "should_apply": _stack_local(strategy, should_apply),
            "replica_reads": _stack_local(strategy, reads),
            "variable_copies": _stack_local(strategy, variable),
        }

    def run_all():
        # The same loop runs eagerly (tf.range yields eager tensors) and, under
        # tf.function, as one graph loop.
        arrays = {
            "scale": tf.TensorArray(tf.float32, num_steps),
            "should_apply": tf.TensorArray(tf.bool, num_steps),
            "replica_reads": tf.TensorArray(tf.float32, num_steps),
            "variable_copies": tf.TensorArray(tf.float32, num_steps),
        }
        for step in tf.range(num_steps):
            observed = one_step(step)
            arrays = {k: a.write(step, observed[k]) for k, a in arrays.items()}
        return {k: a.stack() for k, a in arrays.items()}

    with strategy.scope():
        result = (tf.function(run_all) if in_function else run_all)()
    return {k: v.numpy() for k, v in result.items()}


def single_device_trace(poison):
    """The reference algorithm on one device, fed every replica's gradients.

    This is what the whole batch would do without a strategy: the scale after
    each step and whether the step may be applied.
    """
    poison = tf.constant(poison)
    num_steps, num_replicas = poison.shape
    reference = make_reference_loss_scale()

    @tf.function
    def run_all():
        scales = tf.TensorArray(tf.float32, num_steps)
        should_apply = tf.TensorArray(tf.bool, num_steps)
        for step in tf.range(num_steps):
            grads = [gradients_for(poison, step, replica)
                     for replica in range(num_replicas)]
            _, ok = reference.update(grads)
            with tf.control_dependencies([ok]):
                scales = scales.write(step, reference())
            should_apply = should_apply.write(step, ok)
        return scales.stack(), should_apply.stack()

    scales, should_apply = run_all()
    return scales.numpy(), should_apply.numpy()


def assert_every_replica_agrees(observed, expected_scale, expected_apply):
    """Every replica got the expected decision and sees the expected scale."""
    for key, value in observed.items():
        assert value.shape[0] == expected_scale.shape[0], key
    np.testing.assert_array_equal(observed["scale"], expected_scale)
    np.testing.assert_array_equal(
        observed["should_apply"],
        np.broadcast_to(expected_apply[:, None],
                        observed["should_apply"].shape))
    for key in ("replica_reads", "variable_copies"):
        np.testing.assert_array_equal(
            observed[key],
            np.broadcast_to(expected_scale[:, None], observed[key].shape),
            err_msg=key)


def sequence_for(strategy, length):
    replicas = strategy.num_replicas_in_sync
    return (short_schedule(replicas) if length == SHORT_SEQUENCE
            else long_schedule(replicas))


# ---------------------------------------------------------------------------
# Where the state lives.


@pytest.mark.parametrize("strategy_name", MULTI_REPLICA_STRATEGIES)
def test_loss_scale_created_under_mirrored_scope_keeps_a_copy_per_replica(
        strategy_name):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        loss_scale = make_loss_scale()
    assert len(loss_scale.variables) == 2
    for variable in loss_scale.variables:
        assert isinstance(variable, tf.distribute.DistributedValues)
        copies = strategy.experimental_local_results(variable)
        assert len(copies) == strategy.num_replicas_in_sync
        assert ([tf.DeviceSpec.from_string(c.device) for c in copies] ==
                [tf.DeviceSpec.from_string(d)
                 for d in strategy.extended.worker_devices])
    for copy in strategy.experimental_local_results(
            scale_variable(loss_scale)):
        assert copy.numpy() == INITIAL_SCALE


@pytest.mark.parametrize("strategy_name", ("default", "one_device"))
def test_loss_scale_under_single_replica_strategy_has_one_copy(strategy_name):
    strategy = STRATEGIES[strategy_name]()
    with strategy.scope():
        loss_scale = make_loss_scale()
    for variable in loss_scale.variables:
        assert len(strategy.experimental_local_results(variable)) == 1


# ---------------------------------------------------------------------------
# Agreement with the reference and the single-device algorithm.


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
@pytest.mark.parametrize("length", (SHORT_SEQUENCE, LONG_SEQUENCE))
def test_cross_replica_update_matches_reference_under_same_strategy(
        strategy_name, length):
    # Short sequences run eagerly, long ones in one tf.function.
    in_function = length == LONG_SEQUENCE
    strategy = STRATEGIES[strategy_name]()
    poison = sequence_for(strategy, length)
    with strategy.scope():
        ours = make_loss_scale()
        reference = make_reference_loss_scale()
    observed = observe(strategy, ours, poison, "cross_replica", in_function)
    expected = observe(
        strategy, reference, poison, "cross_replica", in_function)

    assert_every_replica_agrees(
        observed, expected["scale"], expected["should_apply"][:, 0])
    single_scale, single_apply = single_device_trace(poison)
    np.testing.assert_array_equal(expected["scale"], single_scale)
    np.testing.assert_array_equal(expected["should_apply"][:, 0], single_apply)


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
@pytest.mark.parametrize("length", (SHORT_SEQUENCE, LONG_SEQUENCE))
def test_replica_context_update_gives_every_replica_the_same_result(
        strategy_name, length):
    in_function = length == LONG_SEQUENCE
    strategy = STRATEGIES[strategy_name]()
    poison = sequence_for(strategy, length)
    with strategy.scope():
        loss_scale = make_loss_scale()
    observed = observe(strategy, loss_scale, poison, "replica", in_function)

    assert observed["should_apply"].shape[1] == strategy.num_replicas_in_sync
    assert_every_replica_agrees(observed, *single_device_trace(poison))


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("length", (SHORT_SEQUENCE, LONG_SEQUENCE))
def test_loss_scale_created_outside_scope_works_under_mirrored_strategy(
        context, length):
    strategy = STRATEGIES["mirrored_4"]()
    poison = sequence_for(strategy, length)
    loss_scale = make_loss_scale()
    observed = observe(
        strategy, loss_scale, poison, context, length == LONG_SEQUENCE)

    assert_every_replica_agrees(observed, *single_device_trace(poison))


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("kind", list(NON_FINITE_KINDS))
@pytest.mark.parametrize(
    "poisoned_replicas", [(0,), (3,), (1, 2), (0, 1, 2, 3)],
    ids=["first", "last", "two_middle", "all"])
def test_non_finite_gradient_on_some_replicas_skips_step_on_all_of_them(
        context, kind, poisoned_replicas):
    strategy = STRATEGIES["mirrored_4"]()
    poison = short_schedule(4, poisoned_replicas, NON_FINITE_KINDS[kind])
    with strategy.scope():
        loss_scale = make_loss_scale()
    observed = observe(strategy, loss_scale, poison, context, in_function=False)

    scale, should_apply = single_device_trace(poison)
    # The oracle skips exactly the poisoned steps, so agreeing with it means
    # every replica skipped them, not only the poisoned ones.
    np.testing.assert_array_equal(
        should_apply, np.isfinite(poison).all(axis=1))
    assert_every_replica_agrees(observed, scale, should_apply)


# ---------------------------------------------------------------------------
# One scalar reduction per step.


class ReductionCounter:
    """Records every value a strategy's `extended` is asked to reduce."""

    def __init__(self, strategy, monkeypatch):
        self.reduced = []
        extended = strategy.extended
        original_reduce_to = extended.reduce_to
        original_batch_reduce_to = extended.batch_reduce_to

        def reduce_to(reduce_op, value, *args, **kwargs):
            self.reduced.append(value)
            return original_reduce_to(reduce_op, value, *args, **kwargs)

        def batch_reduce_to(reduce_op, value_destination_pairs, *args,
                            **kwargs):
            self.reduced.extend(v for v, _ in value_destination_pairs)
            return original_batch_reduce_to(
                reduce_op, value_destination_pairs, *args, **kwargs)

        monkeypatch.setattr(extended, "reduce_to", reduce_to)
        monkeypatch.setattr(extended, "batch_reduce_to", batch_reduce_to)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize(
    "in_function", (False, True), ids=["eager", "function"])
def test_update_reduces_one_scalar_per_step_however_many_gradients(
        context, in_function, monkeypatch):
    strategy = STRATEGIES["mirrored_4"]()
    with strategy.scope():
        loss_scale = make_loss_scale()
    num_gradients = 24

    def gradients():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        # Replica 2's last gradient overflows, so the flags must be combined.
        last = tf.where(replica == 2, INF, 1.0)
        return ([tf.ones([4, 3]) * i for i in range(num_gradients - 1)] +
                [tf.fill([5], last)])

    def step():
        if context == "replica":
            return strategy.run(
                lambda: tf.identity(loss_scale.update(gradients())[1]))
        return loss_scale.update(strategy.run(gradients))[1]

    counter = ReductionCounter(strategy, monkeypatch)
    with strategy.scope():
        should_apply = (tf.function(step) if in_function else step)()

    # Counted while the step is built (traced once, or run once eagerly).
    assert len(counter.reduced) == 1
    for value in counter.reduced:
        for per_replica in strategy.experimental_local_results(value):
            assert per_replica.shape == ()
    assert not any(strategy.experimental_local_results(should_apply))
    assert float(loss_scale()) == INITIAL_SCALE / MULTIPLIER
    assert int(loss_scale.good_steps) == 0


# ---------------------------------------------------------------------------
# Why replica-context support exists, and strategies that are refused.


def test_reference_fails_in_replica_context_where_ours_agrees():
    strategy = STRATEGIES["mirrored_2"]()
    with strategy.scope():
        ours = make_loss_scale()
        reference = make_reference_loss_scale()

    def gradients():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return [tf.fill([2], tf.where(replica == 1, NAN, 1.0))]

    with strategy.scope():
        # TensorFlow's loss scale only supports cross-replica context, so a
        # train step that updates it inside strategy.run crashes.
        with pytest.raises(AttributeError, match="extended"):
            strategy.run(lambda: reference.update(gradients()))
        should_apply = strategy.run(
            lambda: tf.identity(ours.update(gradients())[1]))
    assert [bool(s) for s in strategy.experimental_local_results(
        should_apply)] == [False, False]
    assert float(ours()) == INITIAL_SCALE / MULTIPLIER


CENTRAL_STORAGE_STRATEGIES = {
    "CentralStorageStrategy":
        tf.distribute.experimental.CentralStorageStrategy,
    "CentralStorageStrategyV1":
        tf.compat.v1.distribute.experimental.CentralStorageStrategy,
}


@pytest.mark.parametrize("strategy_name", list(CENTRAL_STORAGE_STRATEGIES))
def test_central_storage_strategy_is_refused_with_clear_error(strategy_name):
    strategy = CENTRAL_STORAGE_STRATEGIES[strategy_name](["/cpu:0", "/cpu:1"])
    # Its variables live on one parameter device, not one per replica.
    with strategy.scope():
        with pytest.raises(ValueError, match="CentralStorageStrategy"):
            make_loss_scale()

    loss_scale = make_loss_scale()
    with strategy.scope():
        with pytest.raises(ValueError, match="CentralStorageStrategy"):
            loss_scale.update([tf.constant([1.0])])
        with pytest.raises(ValueError, match="CentralStorageStrategy"):
            strategy.run(lambda: loss_scale.update([tf.constant([1.0])]))
    # Refused before touching the state.
    assert float(loss_scale()) == INITIAL_SCALE


# ---------------------------------------------------------------------------
# State mirrored by one strategy is only updated under that strategy.


def test_update_outside_the_creating_strategy_is_refused_not_decided_alone():
    # Under MultiWorkerMirroredStrategy, per-worker gradients are plain
    # tensors: an update outside the scope would let each worker decide on its
    # own gradients and the workers would part ways. Mirrored state therefore
    # refuses any update away from its strategy, before touching the state.
    strategy = STRATEGIES["mirrored_2"]()
    with strategy.scope():
        loss_scale = make_loss_scale()
    nan_gradients = [tf.constant([NAN])]

    with pytest.raises(ValueError, match="MirroredStrategy.*outside any"):
        loss_scale.update(nan_gradients)
    with STRATEGIES["one_device"]().scope():
        with pytest.raises(ValueError, match="used under OneDeviceStrategy"):
            loss_scale.update(nan_gradients)
    assert [float(v) for v in scale_variable(loss_scale).values] == [
        INITIAL_SCALE] * 2

    with strategy.scope():
        _, should_apply = loss_scale.update(nan_gradients)
    assert not bool(should_apply)
    assert float(loss_scale()) == INITIAL_SCALE / MULTIPLIER

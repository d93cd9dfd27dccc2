"""`group.iteration()` blocks: the steps of a `LossScaleGroup`'s optimizers
deferred to the block's end, agreed on at once, applied or skipped as the
group's `skip` says, and the scale moved once.

Two Keras 3 `LossScaleOptimizer`s step two variables with gradients given by
hand (a NaN where a test plants it); a skipped optimizer leaves its variable
and slots bit-identical. Eagerly, in a `tf.function`, under XLA and under
MirroredStrategy with the NaN on one replica only.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests.helpers import training
from tf_lossscale.step import loss_scaled_step

pytestmark = pytest.mark.usefixtures("keras_isolation")

_NAN = float("nan")


def _pair(skip="each", strategy=None):
    """`(group, (d, g), (a, b))`: two Adam wrappers in one group, each with
    one variable, built."""
    with strategy.scope() if strategy else contextlib.nullcontext():
        group = tf_lossscale.LossScaleGroup(
            tf_lossscale.DynamicLossScale(2.0**10, 2), skip=skip)
        optimizers = tuple(tf_lossscale.LossScaleOptimizer(
            keras.optimizers.Adam(0.1), loss_scale=group) for _ in range(2))
        variables = (tf.Variable([1.0, 2.0]), tf.Variable([3.0]))
        for optimizer, variable in zip(optimizers, variables):
            optimizer.build([variable])
    return group, optimizers, variables


def _values(optimizer, variable):
    return [variable.numpy()] + [v.numpy() for v in
                                 optimizer.inner_optimizer.variables]


def _step_function(group, optimizers, variables, mode, block=True):
    """`step(d_poison, g_poison)`: each optimizer's gradient is 1024 plus its
    poison (0 or NaN), for the scale 1024 those are unscaled ones."""
    d, g = optimizers
    a, b = variables

    def step(d_poison, g_poison):
        def both():
            d.apply([tf.fill([2], 1024.0) + d_poison], [a])
            g.apply([tf.fill([1], 1024.0) + g_poison], [b])
        if block:
            with group.iteration():
                both()
        else:
            both()

    if mode == "eager":
        return step
    return tf.function(step, jit_compile=mode == "xla")


@pytest.mark.parametrize("mode", ["eager", "tf.function", "xla"])
@pytest.mark.parametrize("skip", ["each", "together"])
def test_a_block_skips_as_the_group_says_and_moves_the_scale_once(mode, skip):
    group, optimizers, variables = _pair(skip)
    step = _step_function(group, optimizers, variables, mode)
    step(tf.constant(0.0), tf.constant(0.0))
    assert float(group()) == 2.0**10
    assert int(group.loss_scale.good_steps) == 1
    before = [_values(o, v) for o, v in zip(optimizers, variables)]
    step(tf.constant(0.0), tf.constant(_NAN))
    assert float(group()) == 2.0**9  # One back-off for the iteration.
    after = [_values(o, v) for o, v in zip(optimizers, variables)]
    skipped = [int(o.skipped_steps) for o in optimizers]
    # The generator's step is skipped either way, bit for bit.
    for now, was in zip(after[1], before[1]):
        np.testing.assert_array_equal(now, was)
    if skip == "each":
        assert skipped == [0, 1]
        assert not np.array_equal(after[0][0], before[0][0])
    else:  # All or nothing.
        assert skipped == [1, 1]
        for now, was in zip(after[0], before[0]):
            np.testing.assert_array_equal(now, was)
    assert [int(v) for v in group.variables] == [0, 0]


def test_steps_in_a_block_wait_for_its_end():
    group, (d, g), (a, b) = _pair()
    with group.iteration():
        d.apply([tf.fill([2], 1024.0)], [a])
        # Not applied yet: a later loss inside the block sees the old value.
        np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
        g.apply([tf.fill([1], 1024.0)], [b])
    assert a.numpy()[0] < 1.0 and b.numpy()[0] < 3.0


def test_an_optimizer_left_out_of_a_block_takes_no_part_in_that_iteration():
    # A critic stepping twice per generator step: a block per step.
    group, (d, g), (a, b) = _pair()
    for _ in range(2):
        with group.iteration():
            d.apply([tf.fill([2], 1024.0)], [a])
    assert int(group.loss_scale.good_steps) == 0  # Grew after two (period 2).
    assert float(group()) == 2.0**11
    with group.iteration():
        g.apply([tf.fill([1], _NAN)], [b])
    assert float(group()) == 2.0**10
    assert [int(d.skipped_steps), int(g.skipped_steps)] == [0, 1]


def test_skip_together_needs_a_block():
    group, (d, _), (a, _) = _pair("together")
    with pytest.raises(ValueError, match="inside `with group.iteration"):
        d.apply([tf.fill([2], 1024.0)], [a])
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
    assert [int(v) for v in group.variables] == [0, 0]


def test_misused_blocks_are_refused():
    group, (d, g), (a, b) = _pair()
    with pytest.raises(ValueError, match="No optimizer of this LossScaleGroup"
                       " stepped inside"):
        with group.iteration():
            pass
    with pytest.raises(ValueError, match="stepped twice inside one"):
        with group.iteration():
            d.apply([tf.fill([2], 1024.0)], [a])
            d.apply([tf.fill([2], 1024.0)], [a])
    with pytest.raises(ValueError, match="cannot be nested"):
        with group.iteration():
            with group.iteration():
                pass
    with pytest.raises(ValueError, match="cannot be\\s+deferred"):
        with group.iteration():
            d.loss_scale.update([tf.constant(1.0)])
    # A block opened around a compiled function is not where its steps are.
    compiled = tf.function(lambda: d.apply([tf.fill([2], 1024.0)], [a]))
    with pytest.raises(ValueError, match="inside the tf.function"):
        with group.iteration():
            compiled()
    # Each refusal left nothing behind: a block works.
    with group.iteration():
        g.apply([tf.fill([1], 1024.0)], [b])
    assert int(g.iterations) == 1


def _agreements(monkeypatch, optimizers):
    """Counts, while tracing, the decisions on finiteness: each optimizer's
    own (its step's `agree` part) and a block's (all its steps at once)."""
    calls = []

    def counted(name, original):
        def agree(*args):
            calls.append(name)
            return original(*args)
        return agree

    for optimizer in optimizers:
        parts = optimizer._step_parts  # pylint: disable=protected-access
        monkeypatch.setattr(optimizer, "_step_parts", parts._replace(
            agree=counted("one optimizer", parts.agree)), raising=False)
    run_together = loss_scaled_step.DeferredStep.run_together
    monkeypatch.setattr(loss_scaled_step.DeferredStep, "run_together",
                        counted("a block", run_together))
    return calls


@pytest.mark.parametrize("skip", ["each", "together"])
def test_under_mirrored_a_nan_on_one_replica_and_one_agreement_per_block(
        skip, monkeypatch):
    strategy = training.mirrored(2)
    group, (d, g), (a, b) = _pair(skip, strategy)
    calls = _agreements(monkeypatch, (d, g))

    @tf.function
    def step(poison):
        def replica_step():
            context = tf.distribute.get_replica_context()
            last = tf.cast(context.replica_id_in_sync_group == 1, tf.float32)
            with group.iteration():
                d.apply([tf.fill([2], 1024.0)], [a])
                # NaN in the generator's gradient on replica 1 only.
                g.apply([tf.fill([1], 1024.0) + poison * last], [b])
        strategy.run(replica_step)

    step(tf.constant(0.0))
    before = [a.numpy(), b.numpy()]
    step(tf.constant(_NAN))
    assert calls == ["a block"]  # One trace, one agreement.
    assert float(group()) == 2.0**9
    np.testing.assert_array_equal(b.numpy(), before[1])
    if skip == "each":
        assert [int(d.skipped_steps), int(g.skipped_steps)] == [0, 1]
        assert not np.array_equal(a.numpy(), before[0])
    else:
        assert [int(d.skipped_steps), int(g.skipped_steps)] == [1, 1]
        np.testing.assert_array_equal(a.numpy(), before[0])
    for variable in (a, b):  # Every replica holds the same values.
        local = strategy.experimental_local_results(variable)
        np.testing.assert_array_equal(local[0].numpy(), local[1].numpy())


def test_without_a_block_each_optimizer_agrees_on_its_own_step(monkeypatch):
    strategy = training.mirrored(2)
    group, (d, g), (a, b) = _pair("each", strategy)
    calls = _agreements(monkeypatch, (d, g))

    @tf.function
    def step():
        def replica_step():
            d.apply([tf.fill([2], 1024.0)], [a])
            g.apply([tf.fill([1], 1024.0)], [b])
        strategy.run(replica_step)

    step()
    assert calls == ["one optimizer"] * 2
    assert int(group.loss_scale.good_steps) == 1

"""`LossScaleGroup`: several optimizers' steps, one step of the scale per
iteration, driven through its members' `update` (no Keras here).

The scale a group's iterations give is TensorFlow's reference
`DynamicLossScale` fed one step per iteration, finite iff every member's
gradients were; each member's `should_apply` is its own flag. Misuse (a
member stepping twice in an iteration, a damaged state, a grouped scale
moved directly, members under different strategies) is refused, changing
nothing, eagerly, in a `tf.function` and under XLA.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests.helpers import reference_oracle
from tests.helpers import training
from tf_lossscale.groups import iteration

_SEED = 42
_NAN = float("nan")


class _Owner:
    """Stands for the optimizer a member joins for (named in messages)."""

    def __init__(self, name):
        self.name = name


def _group(initial=2.0**10, period=3, names=("d", "g", "h"), **kwargs):
    group = tf_lossscale.LossScaleGroup(
        tf_lossscale.DynamicLossScale(initial, period), **kwargs)
    owners = [_Owner(name) for name in names]
    return group, [group.join(owner) for owner in owners], owners


def _grads(finite):
    """The last gradient is NaN unless `finite` (a bool, or a bool tensor:
    one trace for both)."""
    return [tf.constant([1.0, 2.0]), tf.where(finite, 1.0, _NAN)]


def _state(group):
    return [v.numpy() for v in (*group.loss_scale.variables, *group.variables)]


@pytest.mark.parametrize("case", range(6))
def test_the_scale_takes_one_step_per_iteration_as_tensorflows(case):
    rng = reference_oracle.keyed_rng(_SEED, case)
    params = reference_oracle.random_dynamic_params(rng)
    group = tf_lossscale.LossScaleGroup(tf_lossscale.DynamicLossScale(
        **params))
    members = [group.join(_Owner(name)) for name in "abc"]
    iterations = 16
    finite = rng.random((iterations, 3)) >= (0.0, 0.1, 0.3)[case % 3]
    scales = []
    for flags in finite:
        for index in rng.permutation(3):
            _, should_apply = members[index].update(_grads(flags[index]))
            # Each member's own gradients decide its step.
            assert bool(should_apply) == bool(flags[index])
        scales.append(float(group()))
    reference_oracle.assert_same_float32_bits(
        scales, reference_oracle.reference_scales(
            finite.all(axis=1), **params), f"params {params}")


def test_the_scale_moves_when_the_last_member_steps():
    group, (d, g, h), owners = _group(initial=8.0, period=1)
    d.update(_grads(False))
    g.update(_grads(True))
    # Nothing moved yet; the group holds who stepped and the overflow.
    assert float(group()) == 8.0
    assert [int(v) for v in group.variables] == [0b011, 1]
    h.update(_grads(True))
    assert float(group()) == 4.0  # One back-off for the iteration.
    assert [int(v) for v in group.variables] == [0, 0]
    for member in (h, d, g):
        member.update(_grads(True))
    assert float(group()) == 8.0  # One growth (period 1).


@pytest.mark.parametrize("mode", ["eager", "tf.function", "xla"])
def test_a_member_stepping_twice_in_an_iteration_is_refused(mode):
    group, (d, g, h), owners = _group()

    members = {"d": d, "g": g, "h": h}

    def step(name, finite):  # A member as an argument would be a tensor.
        return members[name].update(_grads(finite))[1]

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    if mode == "xla":
        step = tf_lossscale.with_xla_checks(step, d)
    step("d", tf.constant(True))
    before = _state(group)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        step("d", tf.constant(False))
    # A graph's assertion message escapes its quotes.
    message = str(raised.value).replace("\\'", "'")
    assert "'d' stepped twice in one iteration" in message, message
    assert ("optimizers are 'd' (bit 1), 'g' (bit 2), 'h' (bit 4); the bits "
            "of those that stepped in this iteration: 1.") in message, message
    assert "group.iteration()" in message
    for now, was in zip(_state(group), before):
        np.testing.assert_array_equal(now, was)
    # The iteration goes on: the others step, and the scale moves once.
    step("g", tf.constant(True))
    step("h", tf.constant(True))
    assert int(group.loss_scale.good_steps) == 1


def test_under_xla_a_refused_step_halts_later_steps_until_the_host_acts():
    group, (d, g, h), owners = _group(period=1)
    members = {"d": d, "g": g, "h": h}
    step = tf.function(lambda name: members[name].update(_grads(True))[1],
                       jit_compile=True)
    step("d")
    assert not bool(step("d"))  # Refused: recorded, not raised here.
    # Halted: later steps neither apply nor move anything.
    assert not bool(step("g"))
    assert not bool(step("h"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="stepped twice"):
        float(group.loss_scale())  # An eager read acts on the record.
    assert [int(v) for v in group.variables] == [0b001, 0]
    assert float(group()) == 2.0**10


def test_a_damaged_iteration_state_is_refused():
    group, (d, g, h), owners = _group()
    group.variables[0].assign(0b1000)  # No member has that bit.
    before = _state(group)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="iteration_members_stepped=8"):
        d.update(_grads(True))
    for now, was in zip(_state(group), before):
        np.testing.assert_array_equal(now, was)
    group.variables[0].assign(0)
    group.variables[1].assign(2)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"iteration_overflowed=2 \(0 or 1\)"):
        tf.function(lambda: d.update(_grads(True))[1])()


def test_the_grouped_loss_scale_moves_only_through_its_members():
    group, members, owners = _group()
    with pytest.raises(ValueError, match="loss scale of a LossScaleGroup"):
        group.loss_scale.update(_grads(True))
    with pytest.raises(ValueError, match="another LossScaleGroup"):
        tf_lossscale.LossScaleGroup(group.loss_scale)
    assert float(group()) == 2.0**10


def test_members_join_before_the_first_step():
    group, (d, g, h), owners = _group()
    d.update(_grads(True))
    with pytest.raises(ValueError, match="stepped already.*'d', 'g', 'h'"):
        group.join(_Owner("late"))


def test_a_member_whose_optimizer_is_gone_before_the_first_step_is_left_out():
    group = tf_lossscale.LossScaleGroup(tf_lossscale.DynamicLossScale(8.0, 1))
    d = group.join(_Owner("d"))
    group.join(_Owner("gone"))  # Nothing holds it.
    d.update(_grads(True))
    assert float(group()) == 16.0


@pytest.mark.parametrize("arguments, error, match", [
    (dict(loss_scale="static"), TypeError, "must be 'dynamic', a number"),
    (dict(loss_scale=True), TypeError, "must be 'dynamic', a number"),
    (dict(skip="all"), ValueError, "skip must be one of 'each', 'together'"),
    (dict(skip=None), TypeError, "skip must be one of"),
    (dict(loss_scale=0.5), ValueError, "loss_scale_value must be >= 1"),
])
def test_refused_arguments(arguments, error, match):
    with pytest.raises(error, match=match):
        tf_lossscale.LossScaleGroup(**arguments)


def test_a_member_is_no_loss_scale_for_another_group():
    _, (d, _, _), owners = _group()
    with pytest.raises(TypeError, match="member of a LossScaleGroup"):
        tf_lossscale.LossScaleGroup(d)


def test_members_live_under_the_group_strategy():
    strategy = training.mirrored(2)
    with strategy.scope():
        loss_scale = tf_lossscale.DynamicLossScale()
    with pytest.raises(ValueError, match="made under MirroredStrategy.*"
                       "outside any strategy"):
        tf_lossscale.LossScaleGroup(loss_scale)
    with strategy.scope():
        group = tf_lossscale.LossScaleGroup(loss_scale)
    with pytest.raises(ValueError, match="joins it outside any strategy"):
        group.join(_Owner("d"))
    # A group of plain variables: its members under one strategy, any one.
    plain = tf_lossscale.LossScaleGroup()
    with strategy.scope():
        plain.join(_Owner("d"))
    with pytest.raises(ValueError, match="has optimizers made under "
                       "MirroredStrategy.*joins it outside any strategy"):
        plain.join(_Owner("g"))


def test_a_group_of_a_fixed_loss_scale_skips_as_it_says_and_never_moves():
    group = tf_lossscale.LossScaleGroup(
        tf_lossscale.FixedLossScale(4, skip_non_finite=True))
    d, g = group.join(), group.join()
    assert group.variables == ()
    assert not bool(d.update(_grads(False))[1])
    assert bool(g.update(_grads(True))[1])
    assert bool(d.update(_grads(True))[1])  # No iteration to count twice.
    assert float(group()) == float(d()) == 4.0
    never = tf_lossscale.LossScaleGroup(128).join()
    assert never.update(_grads(False))[1] is True


def test_config_round_trips_and_each_optimizer_made_from_it_gets_a_group():
    group, (d, _, _), owners = _group(skip="each")
    config = tf_lossscale.serialize(group)
    assert config == tf_lossscale.serialize(d) == {
        "class_name": "LossScaleGroup",
        "config": {"loss_scale": tf_lossscale.serialize(group.loss_scale),
                   "skip": "each"}}
    again = tf_lossscale.deserialize(config)
    assert isinstance(again, tf_lossscale.LossScaleGroup)
    assert again is not group and again.members == []
    assert tf_lossscale.serialize(again) == config
    assert tf_lossscale.get(config).get_config() == config["config"]
    assert tf_lossscale.get(group) is group


@pytest.mark.parametrize("config, error, match", [
    ({"class_name": "LossScaleGroup", "config": []}, TypeError,
     "must be a dict like"),
    ({"class_name": "LossScaleGroup", "config": {"skip": "each"}},
     ValueError, "'loss_scale' \\(required\\)"),
    ({"class_name": "LossScaleGroup",
      "config": {"loss_scale": "dynamic", "members": 2}},
     ValueError, "takes the keys"),
])
def test_refused_configs(config, error, match):
    with pytest.raises(error, match=match):
        tf_lossscale.deserialize(config)


def test_checkpoints_of_a_member_hold_the_shared_state_bit_for_bit(tmp_path):
    group, (d, g, h), owners = _group()
    d.update(_grads(False))
    g.update(_grads(True))
    saved = _state(group)
    path = tf.train.Checkpoint(optimizer_loss_scale=g).write(
        str(tmp_path / "member"))
    other, members, others = _group(initial=1.0, period=7)
    tf.train.Checkpoint(optimizer_loss_scale=members[1]).read(
        path).assert_consumed()
    for now, was in zip(_state(other), saved):
        np.testing.assert_array_equal(now, was)
    # The names are a plain loss scale's, then the group's.
    names = [name for name, _ in tf.train.list_variables(path)]
    assert any(re.search(r"optimizer_loss_scale/current_loss_scale", n)
               for n in names), names
    assert any(iteration.STEPPED in n for n in names), names

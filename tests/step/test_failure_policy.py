"""What happens when a float16 run keeps overflowing: warn, raise, give up.

`on_min_loss_scale` acts when a back-off is due while the scale is already at
`min_loss_scale`; `max_consecutive_skips` when that many steps in a row were
non-finite. A failing step is recorded first (skipped, counted) and then fails
with `tf.errors.InvalidArgumentError`, eagerly, in a `tf.function`, in a TF1
session and inside `model.fit`; a warning is one line on stderr per
occurrence, in every one of those places. Under XLA (`jit_compile=True`) the
host raises or warns after the call that held the step (`XlaChecks`,
`with_xla_checks`), with the same text; steps after a failure in the same
call change nothing (the host side: tests/xla/test_xla_checks.py; every way
of running an XLA step: tests/xla/test_xla_ways.py). Under MirroredStrategy all replicas fail or warn
together, from one decision (Mirrored is tested without XLA: XLA under
Mirrored on logical CPUs fails in TensorFlow itself).
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
from tests.helpers import policy_runs as runs
import tf_lossscale

_NAN = float("nan")
_WARNING = "tf_lossscale WARNING:"

MODES = ("eager", "tf_function", "tf1_graph", "xla")


class _Steps:
    """Runs one update per call in `mode`; `state()` reads the variables."""

    def __init__(self, mode, **kwargs):
        self.mode = mode
        if mode == "tf1_graph":
            self._graph = tf.Graph()
            with self._graph.as_default():
                self.loss_scale = tf_lossscale.DynamicLossScale(**kwargs)
                self._value = tf.compat.v1.placeholder(tf.float32, [2])
                self._update = self.loss_scale.update([self._value])
                self._session = tf.compat.v1.Session()
                self._session.run(tf.compat.v1.global_variables_initializer())
            return
        self.loss_scale = tf_lossscale.DynamicLossScale(**kwargs)
        update = lambda g: self.loss_scale.update([g])[1]  # pylint: disable=unnecessary-lambda-assignment
        if mode == "tf_function":
            update = tf.function(update)
        elif mode == "xla":
            update = tf_lossscale.with_xla_checks(
                tf.function(update, jit_compile=True), self.loss_scale)
        self._update = update

    def __call__(self, finite):
        value = np.array([1.0, 1.0 if finite else _NAN], np.float32)
        if self.mode == "tf1_graph":
            return bool(self._session.run(self._update,
                                          {self._value: value})[1])
        return bool(self._update(tf.constant(value)))

    def state(self):
        if self.mode == "tf1_graph":
            with self._graph.as_default():
                values = self._session.run(list(self.loss_scale.variables))
            return {re.sub(r"(_\d+)?:\d+$", "", v.name): x.item()
                    for v, x in zip(self.loss_scale.variables, values)}
        return runs.scale_state(self.loss_scale)


def _numbers(message):
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?",
                                         message)]


@pytest.mark.parametrize("mode", MODES)
def test_raise_fails_the_step_at_the_floor_naming_floor_scale_and_count(mode):
    steps = _Steps(mode, initial_loss_scale=4, increment_period=10,
                   min_loss_scale=1, on_min_loss_scale="raise")
    assert steps(True) is True
    assert steps(False) is False  # 4 -> 2
    assert steps(False) is False  # 2 -> 1: reaching the floor is fine
    assert steps.state() == {"current_loss_scale": 1.0, "good_steps": 0,
                             "consecutive_skips": 2}

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        steps(False)  # A back-off from the floor itself.

    message = str(raised.value)
    assert "min_loss_scale=1.0" in message
    assert "current scale 1" in message
    assert "steps skipped in a row for non-finite gradients: 3" in message
    # The step was skipped and counted before the failure.
    assert steps.state() == {"current_loss_scale": 1.0, "good_steps": 0,
                             "consecutive_skips": 3}


@pytest.mark.parametrize("mode", MODES)
def test_max_consecutive_skips_fails_on_the_nth_skip_in_a_row(mode):
    steps = _Steps(mode, initial_loss_scale=2.0**10, increment_period=5,
                   max_consecutive_skips=3)
    for finite in [False, False, True, False, False]:
        steps(finite)  # A finite step restarts the count.
    assert steps.state()["consecutive_skips"] == 2

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        steps(False)

    message = str(raised.value)
    assert "steps skipped in a row for non-finite gradients: 3" in message
    assert "max_consecutive_skips=3" in message
    assert "current loss scale 32" in message
    assert steps.state() == {"current_loss_scale": 32.0, "good_steps": 0,
                             "consecutive_skips": 3}


@pytest.mark.parametrize("mode", MODES)
def test_warn_prints_one_line_per_step_at_the_floor(mode, capfd):
    steps = _Steps(mode, initial_loss_scale=0.5, increment_period=10,
                   min_loss_scale=0.25, hysteresis=2,
                   on_min_loss_scale="warn")
    capfd.readouterr()
    pattern = [False, False, True, False, False, False, True, True]
    lines_after_each_step = []
    for finite in pattern:
        steps(finite)
        lines_after_each_step.append([
            line for line in capfd.readouterr().err.splitlines()
            if _WARNING in line])
    # Steps 0-1 use the budget and back off to the floor (0.25); the budget
    # stays used up (no growth), so each later non-finite step at the floor
    # warns once.
    assert [len(lines) for lines in lines_after_each_step] == [
        0, 0, 0, 1, 1, 1, 0, 0]
    line = lines_after_each_step[5][0]
    assert line.startswith(_WARNING)
    assert "min_loss_scale=0.25" in line and "current scale 0.25" in line
    assert line.rstrip().endswith("gradients: 3")
    assert steps.state()["current_loss_scale"] == 0.25


def test_continue_stays_at_the_floor_silently(capfd):
    loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=2,
                                               min_loss_scale=2)
    capfd.readouterr()
    for _ in range(3):
        _, should_apply = loss_scale.update([tf.constant(_NAN)])
        assert not bool(should_apply)
    assert float(loss_scale()) == 2.0
    assert _WARNING not in capfd.readouterr().err


def test_raise_in_tf_function_runs_no_apply_branch():
    """A `tf.cond` on should_apply, as optimizers use it, never runs."""
    loss_scale = tf_lossscale.DynamicLossScale(initial_loss_scale=1,
                                               on_min_loss_scale="raise")
    applied = tf.Variable(0)
    skipped = tf.Variable(0)

    @tf.function
    def step(g):
        _, should_apply = loss_scale.update([g])
        tf.cond(should_apply, lambda: applied.assign_add(1),
                lambda: skipped.assign_add(1))

    step(tf.constant(1.0))
    with pytest.raises(tf.errors.InvalidArgumentError):
        step(tf.constant(_NAN))
    assert (int(applied.numpy()), int(skipped.numpy())) == (1, 0)


# ---------------------------------------------------------------------------
# model.fit with tf_lossscale.LossScaleOptimizer.


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("mode", runs.FIT_MODES)
def test_fit_fails_with_raise_at_the_floor_and_keeps_the_weights(mode):
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=2, min_loss_scale=1, on_min_loss_scale="raise")
    model, optimizer = runs.compiled(loss_scale, runs.FIT_MODES[mode])
    runs.fit(model, *training.normal_data(runs.BATCH_SIZE))
    weights = [w.numpy() for w in model.weights]

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"min_loss_scale=1\.0.*current scale 1\b"):
        runs.fit(model, *runs.nan_batches(3))

    for weight, before in zip(model.weights, weights):
        np.testing.assert_array_equal(weight.numpy(), before)
    assert int(optimizer.iterations.numpy()) == 1
    assert runs.scale_state(loss_scale)["consecutive_skips"] == 2
    assert float(loss_scale()) == 1.0


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("mode", runs.FIT_MODES)
def test_fit_fails_after_max_consecutive_skips(mode):
    loss_scale = tf_lossscale.DynamicLossScale(max_consecutive_skips=2)
    model, optimizer = runs.compiled(loss_scale, runs.FIT_MODES[mode])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"in a row for non-finite gradients: 2\b"):
        runs.fit(model, *runs.nan_batches(4))
    assert int(optimizer.iterations.numpy()) == 0
    assert float(loss_scale()) == 2.0**13
    assert runs.scale_state(loss_scale)["consecutive_skips"] == 2


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("mode", ["eager", "tf_function", "xla"])
def test_fit_warns_once_per_step_at_the_floor(mode, capfd):
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=1, on_min_loss_scale="warn")
    model, optimizer = runs.compiled(loss_scale, runs.FIT_MODES[mode])
    capfd.readouterr()
    runs.fit(model, *runs.nan_batches(3))
    lines = [line for line in capfd.readouterr().err.splitlines()
             if line.startswith(_WARNING)]
    assert len(lines) == 3, lines
    assert [_numbers(line)[-1] for line in lines] == [1, 2, 3]
    assert int(optimizer.skipped_steps) == 3


# ---------------------------------------------------------------------------
# MirroredStrategy over two logical CPUs: a NaN on replica 1 only.


def _replica_gradient(poison):
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return [tf.fill([2], 1.0) + tf.where(replica == 1, poison, 0.0)]


def _mirrored_setup(**kwargs):
    strategy = training.mirrored(2)
    with strategy.scope():
        loss_scale = tf_lossscale.DynamicLossScale(**kwargs)

    @tf.function
    def step(poison):
        return strategy.run(
            lambda: tf.identity(loss_scale.update(_replica_gradient(poison))[1]))

    return strategy, loss_scale, step


def _copies(strategy, loss_scale):
    return {re.sub(r"(_\d+)?:\d+$", "", v.name): [
        c.numpy().item() for c in strategy.experimental_local_results(v)]
            for v in loss_scale.variables}


def test_mirrored_replicas_fail_together_with_one_shared_state():
    strategy, loss_scale, step = _mirrored_setup(
        initial_loss_scale=8, increment_period=2, hysteresis=2,
        on_min_loss_scale="raise", max_consecutive_skips=5)
    flags = [strategy.experimental_local_results(step(tf.constant(p)))
             for p in [0.0, _NAN, 0.0, _NAN, _NAN, _NAN]]
    # Replica 0 is finite throughout; it skips because replica 1 is not.
    assert [[bool(f) for f in pair] for pair in flags] == [
        [True, True], [False, False], [True, True], [False, False],
        [False, False], [False, False]]
    assert _copies(strategy, loss_scale) == {
        "current_loss_scale": [1.0, 1.0], "good_steps": [0, 0],
        "hysteresis_remaining": [0, 0], "consecutive_skips": [3, 3]}

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="min_loss_scale=1.0"):
        step(tf.constant(_NAN))
    assert _copies(strategy, loss_scale) == {
        "current_loss_scale": [1.0, 1.0], "good_steps": [0, 0],
        "hysteresis_remaining": [0, 0], "consecutive_skips": [4, 4]}


def test_mirrored_warning_is_printed_once_per_step_not_per_replica(capfd):
    _, _, step = _mirrored_setup(initial_loss_scale=1,
                                 on_min_loss_scale="warn")
    capfd.readouterr()
    for _ in range(2):
        step(tf.constant(_NAN))
    lines = [line for line in capfd.readouterr().err.splitlines()
             if line.startswith(_WARNING)]
    assert len(lines) == 2, lines


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("mode", runs.FIT_MODES)
def test_fit_raise_comes_before_the_weights_change_again(mode):
    # NaN at the floor, then finite batches: under XLA with two steps per
    # call the failed step halts the call, the finite one after it in the
    # same call is not applied.
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=1, on_min_loss_scale="raise")
    model, optimizer = runs.compiled(loss_scale, runs.FIT_MODES[mode])
    x, y = training.normal_data(runs.BATCH_SIZE)
    weights = [w.numpy() for w in model.weights]
    x_nan = x.copy()
    x_nan[0, 0] = _NAN
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"min_loss_scale=1\.0.*gradients: 1\b"):
        runs.fit(model, np.concatenate([x_nan, x, x]),
                 np.concatenate([y, y, y]))
    for weight, before in zip(model.weights, weights):
        np.testing.assert_array_equal(weight.numpy(), before)
    assert int(optimizer.iterations.numpy()) == 0
    assert int(optimizer.skipped_steps) == 0
    assert runs.scale_state(loss_scale)["consecutive_skips"] == 1

"""`Triggers` calls a run failed on what the loss scale keeps, and only then;
`FailureWatch` refuses bad arguments naming them."""

import math

import numpy as np
import pytest

import tf_lossscale
from tf_lossscale.watch import triggers as triggers_lib


class _Scale:
    """A loss scale's face as the triggers read it: a value and a floor."""

    def __init__(self, value, floor=1.0):
        self.value, self.min_loss_scale = value, floor

    def __call__(self):
        return self.value


class _Optimizer:
    def __init__(self, scale):
        self.loss_scale, self.skipped_steps, self.iterations = scale, 0, 0

    def step(self, skipped, scale=None):
        self.skipped_steps += skipped
        if scale is not None:
            self.loss_scale.value = scale


def _run(triggers, optimizer, steps):
    """Feeds `(skipped, scale, loss)` steps; the step (from 1) and reason
    of the first failure, or None."""
    triggers.start(optimizer)
    for index, (skipped, scale, loss) in enumerate(steps, start=1):
        optimizer.step(skipped, scale)
        why = triggers.after(1, loss)
        if why is not None:
            return index, why
    return None


def test_a_healthy_run_with_rare_skips_never_fails():
    optimizer = _Optimizer(_Scale(2.0**15))
    steps = [(1 if i % 100 == 0 else 0, None, 0.5) for i in range(1, 1000)]
    assert _run(triggers_lib.Triggers(), optimizer, steps) is None


def test_skips_in_a_row_fail_at_the_limit_once_the_scale_settled():
    optimizer = _Optimizer(_Scale(2.0**15, floor=1e-30))
    steps = [(0, None, 0.5)] * 5 + [
        (1, 2.0**(14 - i), 0.5) for i in range(30)]
    step, why = _run(triggers_lib.Triggers(max_consecutive_skips=7,
                                           scale_drop_binades=None,
                                           settle_steps=5),
                     optimizer, steps)
    assert step == 5 + 7
    assert "7 steps in a row" in why


def test_a_burst_of_skips_before_the_scale_settled_is_no_failure():
    optimizer = _Optimizer(_Scale(2.0**40, floor=1.0))
    steps = [(1, 2.0**(39 - i), 0.5) for i in range(25)] + [
        (0, None, 0.5)] * 100
    assert _run(triggers_lib.Triggers(max_consecutive_skips=7),
                optimizer, steps) is None


def test_a_skip_at_the_floor_fails_but_reaching_it_does_not():
    optimizer = _Optimizer(_Scale(4.0, floor=1.0))
    steps = [(1, 2.0, 0.5), (1, 1.0, 0.5), (1, 1.0, 0.5)]
    step, why = _run(triggers_lib.Triggers(max_consecutive_skips=None),
                     optimizer, steps)
    assert step == 3
    assert "floor" in why


def test_a_non_finite_loss_fails_once_enough_steps_were_skipped():
    optimizer = _Optimizer(_Scale(2.0**15))
    steps = [(0, None, 0.5)] * 3 + [(1, 2.0**(14 - i), math.nan)
                                     for i in range(10)]
    step, why = _run(triggers_lib.Triggers(nonfinite_loss_steps=2),
                     optimizer, steps)
    assert step == 3 + 2
    assert "not finite" in why


def test_a_non_finite_running_loss_without_skips_does_not_fail():
    # Keras' logged loss is the epoch's running mean: one bad batch keeps it
    # NaN while the steps after it are applied.
    optimizer = _Optimizer(_Scale(2.0**15))
    steps = [(1, 2.0**14, math.nan)] + [(0, None, math.nan)] * 50
    assert _run(triggers_lib.Triggers(), optimizer, steps) is None


def test_the_scale_falling_below_where_it_settled_fails():
    optimizer = _Optimizer(_Scale(2.0**12, floor=1e-30))
    # Settles at 2**12 for 10 steps, then backs off every other step.
    steps = [(0, None, 0.5)] * 10
    for i in range(1, 20):
        steps += [(1, 2.0**(12 - i), 0.5), (0, None, 0.5)]
    triggers = triggers_lib.Triggers(max_consecutive_skips=None,
                                     scale_drop_binades=5, settle_steps=10)
    step, why = _run(triggers, optimizer, steps)
    assert triggers.settled_scale == 2.0**12
    assert step == 10 + 2 * 5 - 1
    assert "5 powers of 2 below" in why


@pytest.mark.parametrize("name, value, error", [
    ("max_consecutive_skips", 0, ValueError),
    ("nonfinite_loss_steps", 1.5, TypeError),
    ("scale_drop_binades", -1, ValueError),
    ("settle_steps", 0, ValueError),
    ("at_floor", 1, TypeError),
])
def test_bad_trigger_arguments_are_refused_by_name(name, value, error):
    with pytest.raises(error, match=name):
        triggers_lib.Triggers(**{name: value})


@pytest.mark.parametrize("kwargs, error, name", [
    ({"on_failure": "ignore"}, ValueError, "on_failure"),
    ({"steps": 0}, ValueError, "steps"),
    ({"baseline": "yes"}, TypeError, "baseline"),
    ({"directory": 3}, TypeError, "directory"),
    ({"settle_steps": -2}, ValueError, "settle_steps"),
])
def test_bad_watch_arguments_are_refused_by_name(kwargs, error, name):
    with pytest.raises(error, match=name):
        tf_lossscale.FailureWatch([], **kwargs)


def test_data_is_required():
    with pytest.raises(ValueError, match="data"):
        tf_lossscale.FailureWatch(None)


def test_a_model_without_a_tf_lossscale_optimizer_is_refused(
        keras_isolation):
    del keras_isolation
    import keras  # pylint: disable=g-import-not-at-top
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    watch = tf_lossscale.FailureWatch([(np.zeros((1, 2)), np.zeros((1, 1)))])
    with pytest.raises(TypeError, match="FailureWatch needs a model"):
        watch.start(model)


def test_a_model_the_diagnosis_cannot_run_is_refused_at_the_start(
        keras_isolation):
    del keras_isolation
    import keras  # pylint: disable=g-import-not-at-top

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD()), loss="mse")
    watch = tf_lossscale.FailureWatch([(np.zeros((1, 2)), np.zeros((1, 1)))])
    with pytest.raises(TypeError, match="FailureWatch supports functional"):
        watch.start(model)

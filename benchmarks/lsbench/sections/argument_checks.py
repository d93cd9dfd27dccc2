"""What refusing hostile inputs costs a step (eager work, no graph op).

1. The eager lock (`tf_lossscale.loss_scales.eager_lock`): an eager
   `DynamicLossScale.update` of a few small gradients, with its lock and
   with the lock replaced by one that does nothing, and the lock alone
   (taken and released, timed a thousand at a time). The update is the
   cheapest eager step a loss scale takes, so the lock's share is the
   largest it can be.
2. The step's argument checks (`tf_lossscale._internal.checks`): an eager
   `apply_gradients` of the Keras 3 `LossScaleOptimizer` (SGD inside) on
   200 small variables (20 in quick runs), with the checks and with them
   replaced by a plain `list`, and the checks alone. Many small variables
   make the per-variable checks weigh the most. Inside a `tf.function` the
   checks run only while tracing (`tests/step/test_hostile_inputs.py` proves
   they add no op to the graph), so `fit` does not pay them per step.

The whole-step ratios carry the machine's noise (a few percent on a shared
machine); the "alone" rows resolve what the noise hides. No target: the
rows in the cost per feature say what each costs.
"""

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale
from lsbench import timing
from lsbench.sections import fit_step
from tf_lossscale._internal import checks

NAME = "checks"
TITLE = "Eager costs"
LOCK = "the eager lock"
CHECKS = "the argument checks"

_LOCK_TIMES = 1000


class _NoLock:
    """Stands in for an `EagerLock`: holds nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


def _repeated(fn, times):
    """`fn` run `times` times per call: for costs too small to time once."""

    def run():
        for _ in range(times):
            fn()

    return run


def _medians(samples):
    return {name: sorted(values)[len(values) // 2]
            for name, values in samples.cpu.items()}


def _show(report, title, medians, baseline):
    table = report.table(title, ["run", "µs per call (CPU)",
                                 f"x {baseline}"])
    for name, seconds in medians.items():
        table.add(name, f"{seconds * 1e6:.1f}",
                  f"x{seconds / medians[baseline]:.4f}")
    report.show(table)


def eager_lock_cost(report, settings):
    """Part 1; returns (the lock's seconds, its share of an unlocked
    update)."""
    grads = [tf.constant(np.ones(shape, np.float32))
             for shape in ((16,), (16, 16), (4,), (8, 8))]
    locked = tf_lossscale.DynamicLossScale(increment_period=10**9)
    unlocked = tf_lossscale.DynamicLossScale(increment_period=10**9)
    unlocked._eager_lock = _NoLock()  # pylint: disable=protected-access
    lock = locked._eager_lock  # pylint: disable=protected-access

    def take_lock():
        if tf.executing_eagerly():  # As the decorated update does.
            with lock:
                pass

    alone = f"the lock alone (x{_LOCK_TIMES})"
    medians = _medians(timing.interleaved({
        "update, lock held": lambda: locked.update(grads),
        "update, no lock": lambda: unlocked.update(grads),
        alone: _repeated(take_lock, _LOCK_TIMES),
    }, settings.step_rounds, 4 * settings.calls))
    medians[alone] /= _LOCK_TIMES
    _show(report, f"{TITLE}: the lock, in DynamicLossScale.update (4 small "
          "gradients)", medians, "update, no lock")
    return medians[alone], medians[alone] / medians["update, no lock"]


def step_check_cost(report, settings):
    """Part 2; returns (the checks' seconds, their share of an unchecked
    step)."""
    count = 20 if settings.quick else 200
    rng = np.random.default_rng(0)
    weights = [keras.Variable(rng.standard_normal(16).astype(np.float32))
               for _ in range(count)]
    grads = [tf.constant(rng.standard_normal(16).astype(np.float32))
             for _ in range(count)]
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(1e-6), loss_scale=1)
    pairs = list(zip(grads, weights))
    checked = checks.gradients

    def step(check):
        checks.gradients = check
        try:
            optimizer.apply_gradients(pairs)
        finally:
            checks.gradients = checked

    medians = _medians(timing.interleaved({
        "apply_gradients, checked": lambda: step(checked),
        "apply_gradients, checks skipped": lambda: step(
            lambda grads, _: list(grads)),
        "the checks alone": lambda: checked(grads, weights),
    }, settings.step_rounds, 4 * settings.calls))
    _show(report, f"{TITLE}: the argument checks, in apply_gradients "
          f"({count} variables of 16 values)", medians,
          "apply_gradients, checks skipped")
    return (medians["the checks alone"], medians["the checks alone"]
            / medians["apply_gradients, checks skipped"])


def run(context):
    """Returns {"eager lock": share, "step checks": share}: each cost's
    share of the eager step it runs in."""
    report, settings = context.report, context.settings
    report.line(f"\n{NAME}: {TITLE}: the eager lock and the argument "
                "checks, each with and without, and alone")
    lock_seconds, lock_share = eager_lock_cost(report, settings)
    check_seconds, check_share = step_check_cost(report, settings)
    report.line(f"  shares of the eager step they run in: eager lock "
                f"{lock_share:.2%}, step checks {check_share:.2%}")
    features = report.shared_table(fit_step.FEATURES_TITLE,
                                   fit_step.FEATURES_COLUMNS)
    features.add(f"{LOCK} (eager update; {lock_share:.2%} of it)", "eager",
                 "0", "-", f"+{lock_seconds * 1e6:.1f}", "0 (no graph op)")
    features.add(f"{CHECKS} (eager apply_gradients; {check_share:.2%} of "
                 "it)", "eager", "0", "-", f"+{check_seconds * 1e6:.1f}",
                 "0 (tracing only)")
    return {"eager lock": lock_share, "step checks": check_share}

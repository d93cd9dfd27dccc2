"""What refusing hostile inputs costs a step, as ratios measured in one run.

Every comparison runs its candidates in interleaved rounds within this one
process and prints the ratio of their medians (machines here are shared and
noisy: absolute times mean little).

1. The eager lock (`tf_lossscale.eager_lock`): an eager
   `DynamicLossScale.update` of a few small gradients, with its lock and
   with the lock replaced by one that does nothing, and the lock alone
   (taken and released). The update is the cheapest eager step a loss scale
   takes, so the lock's share is the largest it can be.
2. The step's argument checks (`tf_lossscale.step_arguments`): an eager
   `apply_gradients` of the Keras 3 `LossScaleOptimizer` (SGD inside) on 200
   small variables, with the checks and with them replaced by a plain
   `list`, and the checks alone. Many small variables make the per-variable
   checks weigh the most. Inside a `tf.function` the checks run only while
   tracing (`tests/test_hostile_inputs.py` proves they add no op to the
   graph).

The whole-step ratios carry the machine's noise (a few percent on a shared
machine); the "alone" rows resolve what the noise hides.

Run: python benchmarks/hostile_input_costs.py [--quick] [--rounds=N]
"""

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np
import tensorflow as tf

import tf_lossscale
from tf_lossscale import step_arguments


class _NoLock:
    """Stands in for an `EagerLock`: holds nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


def _interleaved(candidates, rounds, calls):
    """Median seconds per call of each candidate, run in interleaved
    rounds after one warm-up call each."""
    for fn in candidates.values():
        fn()
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


def _repeated(fn, times):
    """`fn` run `times` times per call: for costs too small to time once."""

    def run():
        for _ in range(times):
            fn()

    return run


def _print_ratio(out, title, medians, baseline):
    print(title, file=out)
    for name, seconds in medians.items():
        print(f"  {name:<44} {seconds * 1e6:9.1f} us  "
              f"x{seconds / medians[baseline]:.4f}", file=out)


def eager_lock_cost(out, rounds, calls):
    """Section 1; returns the lock's share of an unlocked update."""
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

    medians = _interleaved({
        "update, lock held": lambda: locked.update(grads),
        "update, no lock": lambda: unlocked.update(grads),
        "the lock alone (x1000)": _repeated(take_lock, 1000),
    }, rounds, calls)
    medians["the lock alone (x1000)"] /= 1000
    _print_ratio(out, "\n1. Eager DynamicLossScale.update (4 small "
                 "gradients): the lock", medians, "update, no lock")
    return medians["the lock alone (x1000)"] / medians["update, no lock"]


def step_check_cost(out, rounds, calls, variables=200):
    """Section 2; returns the checks' share of an unchecked step."""
    rng = np.random.default_rng(0)
    weights = [keras.Variable(rng.standard_normal(16).astype(np.float32))
               for _ in range(variables)]
    grads = [tf.constant(rng.standard_normal(16).astype(np.float32))
             for _ in range(variables)]
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(1e-6), loss_scale=1)
    pairs = list(zip(grads, weights))
    checked = step_arguments.check

    def step(check):
        step_arguments.check = check
        try:
            optimizer.apply_gradients(pairs)
        finally:
            step_arguments.check = checked

    medians = _interleaved({
        "apply_gradients, checked": lambda: step(checked),
        "apply_gradients, checks skipped": lambda: step(
            lambda grads, _: list(grads)),
        "the checks alone": lambda: checked(grads, weights),
    }, rounds, calls)
    _print_ratio(out, f"\n2. Eager apply_gradients ({variables} variables "
                 "of 16 values): the argument checks", medians,
                 "apply_gradients, checks skipped")
    return (medians["the checks alone"]
            / medians["apply_gradients, checks skipped"])


def run(quick=False, rounds=None, out=sys.stdout):
    """Runs both measurements; returns {section: share of the step}.
    `quick` checks that the script runs; its figures mean nothing."""
    rounds = rounds or (1 if quick else 21)
    calls = 1 if quick else 20
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
          f"{os.cpu_count()} CPUs, load average {load:.2f}; median of "
          f"{rounds} interleaved rounds{' (quick)' if quick else ''}",
          file=out)
    shares = {
        "eager lock": eager_lock_cost(out, rounds, calls),
        "step checks": step_check_cost(out, rounds, calls,
                                       variables=20 if quick else 200),
    }
    print("\nShares of the step they run in:", file=out)
    for name, share in shares.items():
        print(f"  {name:<12} {share:.2%}", file=out)
    return shares


def main(argv):
    options = {}
    for arg in argv:
        if arg == "--quick":
            options["quick"] = True
        elif arg.startswith("--rounds="):
            options["rounds"] = int(arg.split("=", 1)[1])
        else:
            raise SystemExit(f"unknown argument {arg!r}; use --quick or "
                             "--rounds=N")
    run(**options)


if __name__ == "__main__":
    main(sys.argv[1:])

"""What `LossScaleMonitor(gradient_stats=True)` costs, as ratios from one run.

Machines here are noisy and shared, so absolute times mean little: each
comparison runs its candidates in interleaved rounds within this process,
takes medians, and prints ratios.

1. The per-step statistics alone (`gradient_stats.scaled_gradient_stats`:
   zero-or-subnormal count and largest magnitude) against the finiteness
   check every step already runs (`gradient_checks.all_finite`), on the
   same gradients: a ResNet-50-like set (161 tensors, 25.5M values), 1000
   tensors of 1000 values, 4 tensors of 8M values.
2. `model.fit` of a 6x512 MLP (batch 128) with `LossScaleMonitor()` and
   with the statistics on, in process CPU time and wall time, each round's
   runs divided by that round's run without them; without XLA and with
   `jit_compile=True`. The statistics stay attached across the timed
   fits: this is their cost per step; the monitor also retraces the step
   once when training begins and once when it ends. They are attached as
   the monitor attaches them, with every variable watched: the step
   computes in mixed_bfloat16,
   as in `loss_scale_benchmark.py`, because TensorFlow's CPU build has no
   fast float16 matrix product (it would hide the cost), and under bfloat16
   no layer computes in float16, so the monitor itself would watch none.
   The statistics read the float32 gradients: the same work either way.

Run: python benchmarks/gradient_stats_cost.py [--quick]
"""

import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import tf_lossscale  # pylint: disable=g-import-not-at-top
from tf_lossscale import gradient_checks  # pylint: disable=g-import-not-at-top
from tf_lossscale import gradient_stats  # pylint: disable=g-import-not-at-top
from tf_lossscale import step_gradient_stats  # pylint: disable=g-import-not-at-top

_SEED = 0
_SCALE = 2.0 ** 15


def _resnet50_shapes():
    """ResNet-50's trainable shapes: 161 tensors, 25.5M values."""
    shapes = [(7, 7, 3, 64), (64,), (64,)]
    channels = 64
    for blocks, mid, out in ((3, 64, 256), (4, 128, 512), (6, 256, 1024),
                             (3, 512, 2048)):
        for block in range(blocks):
            shapes += [(1, 1, channels, mid), (mid,), (mid,),
                       (3, 3, mid, mid), (mid,), (mid,),
                       (1, 1, mid, out), (out,), (out,)]
            if block == 0:
                shapes += [(1, 1, channels, out), (out,), (out,)]
            channels = out
    return shapes + [(channels, 1000), (1000,)]


def gradient_sets(quick):
    if quick:
        return {"64 x 1000": [(1000,)] * 64, "2 x 64K": [(65536,)] * 2}
    return {"ResNet-50-like": _resnet50_shapes(),
            "1000 x 1000": [(1000,)] * 1000,
            "4 x 8M": [(8_000_000,)] * 4}


def _interleaved(candidates, rounds, calls):
    """name -> median seconds per call, over interleaved rounds."""
    for fn in candidates.values():
        fn()  # Trace and warm up outside the measurement.
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return {name: statistics.median(s) for name, s in samples.items()}


def statistics_vs_check(out, quick, rounds, calls):
    """Section 1; returns {set name: stats time / check time}."""
    print("1. Per-step statistics against the finiteness check, same "
          "gradients (median seconds per call, ratio)", file=out)
    ratios = {}
    scale = tf.constant(_SCALE)
    for name, shapes in gradient_sets(quick).items():
        rng = np.random.default_rng(_SEED)
        grads = [tf.constant(rng.standard_normal(s).astype(np.float32))
                 for s in shapes]
        check = tf.function(lambda: gradient_checks.all_finite(grads))
        stats = tf.function(
            lambda: gradient_stats.scaled_gradient_stats(grads, scale))
        medians = _interleaved({"check": lambda: check().numpy(),
                                "stats": lambda: stats().numpy()},
                               rounds, calls)
        ratios[name] = medians["stats"] / medians["check"]
        print(f"  {name:<16} check {medians['check'] * 1e3:8.3f} ms   "
              f"statistics {medians['stats'] * 1e3:8.3f} ms   "
              f"x{ratios[name]:.2f}", file=out, flush=True)
    return ratios


class _StatsLogger(keras.callbacks.Callback):
    """What `LossScaleMonitor(gradient_stats=True)` adds to the monitor on
    each batch: one read. The statistics are attached once, before the
    timed fits (`_attach`), so the per-step cost is timed without the one
    retrace at the start and end of each fit that the monitor adds."""

    def __init__(self, stats):
        super().__init__()
        self._stats = stats

    def on_train_batch_end(self, batch, logs=None):
        logs["grad_underflow_share"], logs["grad_headroom_log2"] = (
            self._stats.read())


def _attach(model):
    """Attaches the statistics as the monitor does, every variable watched,
    and re-makes the train function."""
    stats = step_gradient_stats.attach(
        model.optimizer, model.trainable_variables,
        model.distribute_strategy)
    model.make_train_function(force=True)
    return stats


def _mlp_run(width, jit_compile, with_stats):
    keras.utils.set_random_seed(_SEED)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu",
                              dtype="mixed_bfloat16") for _ in range(6)]
        + [keras.layers.Dense(10, dtype="float32")])
    with warnings.catch_warnings():
        # tf_lossscale warns that bfloat16 needs no scaling: here the
        # scaling is what is measured.
        warnings.simplefilter("ignore", UserWarning)
        optimizer = tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(0.01))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  jit_compile=jit_compile)
    callbacks = [tf_lossscale.LossScaleMonitor()]
    if with_stats:
        optimizer.build(model.trainable_variables)
        callbacks.append(_StatsLogger(_attach(model)))
    return model, callbacks


def fit_cost(out, quick, rounds, jit_compile):
    """Section 2 (one compile mode); returns (CPU ratio, wall ratio) of the
    fit with statistics to the fit without."""
    width, batch_size, steps = (64, 32, 10) if quick else (512, 128, 50)
    rng = np.random.default_rng(_SEED)
    x = rng.standard_normal((steps * batch_size, width)).astype(np.float32)
    y = rng.integers(0, 10, steps * batch_size)
    runs = {"monitor": _mlp_run(width, jit_compile, False),
            "monitor + statistics": _mlp_run(width, jit_compile, True)}

    def fit(name):
        model, callbacks = runs[name]
        cpu, wall = time.process_time(), time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                  shuffle=False, callbacks=callbacks)
        return time.process_time() - cpu, time.perf_counter() - wall

    for name in runs:
        fit(name)  # Trace and warm up.
    cpu_ratios, wall_ratios = [], []
    for _ in range(rounds):
        times = {name: fit(name) for name in runs}
        cpu_ratios.append(times["monitor + statistics"][0]
                          / times["monitor"][0])
        wall_ratios.append(times["monitor + statistics"][1]
                           / times["monitor"][1])
    cpu, wall = statistics.median(cpu_ratios), statistics.median(wall_ratios)
    mode = "XLA (jit_compile=True)" if jit_compile else "no XLA"
    print(f"  6x{width} MLP, batch {batch_size}, {steps} steps per fit, "
          f"{mode}: CPU time x{cpu:.3f}, wall time x{wall:.3f}",
          file=out, flush=True)
    return cpu, wall


def run(quick=False, out=None):
    """Runs both sections; returns the measured ratios as a dict."""
    out = out or sys.stdout
    rounds, calls = (3, 2) if quick else (15, 5)
    fit_rounds = 3 if quick else 9
    load = os.getloadavg()[0]
    print(f"gradient statistics cost: {os.cpu_count()} CPUs, load average "
          f"{load:.2f}; medians of {rounds} (section 1) and {fit_rounds} "
          f"(section 2) interleaved rounds{' (quick)' if quick else ''}",
          file=out, flush=True)
    results = {"statistics_vs_check": statistics_vs_check(
        out, quick, rounds, calls)}
    print("2. model.fit with LossScaleMonitor, with the statistics / "
          "without (median per-round ratio; per step: the monitor's one "
          "retrace when training begins and ends is not included)",
          file=out, flush=True)
    results["fit"] = fit_cost(out, quick, fit_rounds, jit_compile=False)
    results["fit_xla"] = fit_cost(out, quick, fit_rounds, jit_compile=True)
    return results


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    unknown = [arg for arg in argv if arg != "--quick"]
    if unknown:
        raise SystemExit(f"unknown arguments: {' '.join(unknown)}; usage: "
                         "gradient_stats_cost.py [--quick]")
    run(quick="--quick" in argv)


if __name__ == "__main__":
    main()

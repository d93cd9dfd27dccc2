"""`model.fit` of one MLP under several optimizers, timed side by side.

The model is a 6x512 MLP (batch 128; 1x16, batch 16, in quick runs) that
computes in mixed_bfloat16, not mixed_float16: TensorFlow's CPU build has no
fast float16 matrix product (a float16 step of this MLP took 3.7 s on this
project's machines, 7 ms in bfloat16), which would hide every overhead,
while the loss-scaling work (float32 variables and gradients, the same
scale, check, skip and update) is the same in both.

Every candidate fits the same data once per round, in turn; each round's
times are divided by that round's "no loss scaling" run, and the medians of
those ratios are reported, in process CPU time (all threads) and wall time.
"""

import statistics
import time
import warnings
from typing import Callable, NamedTuple

import keras
import numpy as np

from lsbench import gradient_sets

BASELINE = "no loss scaling"


class Candidate(NamedTuple):
    """How to compile one run.

    Attributes:
      optimizer: `optimizer(inner_sgd)` -> the optimizer to compile with, or
        None to compile the SGD itself (no loss scaling).
      callbacks: callables, each returning a callback for `fit`.
      inner: the inner optimizer's class.
    """
    optimizer: Callable = None
    callbacks: tuple = ()
    inner: Callable = keras.optimizers.SGD


class FitShape(NamedTuple):
    depth: int  # Hidden layers.
    width: int
    batch_size: int
    steps: int
    rounds: int


def fit_shape(settings):
    quick = settings.quick
    # Quick: one hidden layer takes the paths six take (every variable
    # alike), in less tracing.
    return FitShape(depth=1 if quick else 6, width=16 if quick else 512,
                    batch_size=16 if quick else 128,
                    steps=settings.fit_steps or (2 if quick else 60),
                    rounds=settings.fit_rounds or (1 if quick else 9))


def mlp(shape):
    keras.utils.set_random_seed(gradient_sets.SEED)
    return keras.Sequential(
        [keras.Input((shape.width,))]
        + [keras.layers.Dense(shape.width, activation="relu")
           for _ in range(shape.depth)]
        + [keras.layers.Dense(10, dtype="float32")])


def data(shape):
    rng = np.random.default_rng(gradient_sets.SEED)
    count = shape.steps * shape.batch_size
    x = rng.standard_normal((count, shape.width)).astype(np.float32)
    return x, rng.integers(0, 10, count)


def build(candidates, shape, jit_compile=False, strategy=None):
    """name -> (model, callbacks), each compiled under mixed_bfloat16 (in
    `strategy.scope()` when given)."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        with warnings.catch_warnings():
            # tf_lossscale warns that bfloat16 needs no scaling: here the
            # scaling is what is measured.
            warnings.simplefilter("ignore", UserWarning)
            runs = {}
            for name, candidate in candidates.items():
                if strategy is None:
                    runs[name] = _compile(candidate, shape, jit_compile)
                else:
                    with strategy.scope():
                        runs[name] = _compile(candidate, shape, jit_compile)
            return runs
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _compile(candidate, shape, jit_compile):
    model = mlp(shape)
    inner = candidate.inner(0.01)
    if candidate.optimizer is None:
        model.compile(optimizer=inner, auto_scale_loss=False,
                      loss="sparse_categorical_crossentropy",
                      jit_compile=jit_compile)
    else:
        model.compile(optimizer=candidate.optimizer(inner),
                      loss="sparse_categorical_crossentropy",
                      jit_compile=jit_compile)
    return model, [make() for make in candidate.callbacks]


class Ratios(NamedTuple):
    """name -> median per-round ratio to the baseline's time."""
    cpu: dict
    wall: dict

    def overhead(self, name):
        """CPU time over no loss scaling, as a share of an unscaled step."""
        return self.cpu[name] - 1.0


def interleaved_fits(runs, shape, rounds):
    """Fits every run once per round, in turn; returns `Ratios`."""
    x, y = data(shape)

    def fit(name):
        model, callbacks = runs[name]
        cpu, wall = time.process_time(), time.perf_counter()
        model.fit(x, y, batch_size=shape.batch_size, epochs=1, verbose=0,
                  shuffle=False, callbacks=callbacks)
        return time.process_time() - cpu, time.perf_counter() - wall

    for name in runs:
        fit(name)  # Trace and warm up.
    cpu = {name: [] for name in runs}
    wall = {name: [] for name in runs}
    for _ in range(rounds):
        times = {name: fit(name) for name in runs}
        base_cpu, base_wall = times[BASELINE]
        for name, (cpu_time, wall_time) in times.items():
            cpu[name].append(cpu_time / base_cpu)
            wall[name].append(wall_time / base_wall)
    return Ratios({n: statistics.median(v) for n, v in cpu.items()},
                  {n: statistics.median(v) for n, v in wall.items()})


def show(report, ratios):
    report.line(f"  {'':<46} {'CPU time':>9} {'wall time':>10}"
                "   (median per-round ratio to no loss scaling)")
    for name in ratios.cpu:
        report.line(f"  {name:<46} x{ratios.cpu[name]:.3f}   "
                    f"x{ratios.wall[name]:.3f}")


def percent(share):
    return f"{share * 100:+.1f}%"

"""Side-by-side cost of loss scaling, printed as ratios measured in one run.

Machines here are noisy and shared, so absolute times mean little: every
comparison runs its candidates in interleaved rounds within this one process,
takes medians, and prints ratios, with each target and whether it holds.

1. Check + unscale + update on three gradient sets (a ResNet-50-like set of
   161 tensors / 25.5M values, 1000 tensors of 1000, 4 tensors of 8M):
   a bare unscale (one multiply per gradient), Keras 3's `check_finite` and
   its divide, TF's reference (divide, then `update`), tf_lossscale's TF2
   protocol (`get_unscaled_gradients`, then `loss_scale.update`), and
   tf_lossscale's finiteness check alone.
2. The Keras-protocol apply path: scaled gradients into `apply` with an SGD
   inner optimizer, against Keras 3's wrapper and a bare
   `SGD.apply(g * 1/scale)`.
3. `model.fit` step cost of a 6x512 MLP (batch 128), in process CPU time
   (all threads) and wall time: no loss scaling, Keras 3's wrapper,
   tf_lossscale, and tf_lossscale with its `LossScaleMonitor` callback. Each
   round's runs are divided by that round's unscaled run; the medians of
   those ratios are reported. The step computes in mixed_bfloat16, not
   mixed_float16: TensorFlow's CPU build has no fast float16 matrix product
   (measured here: 3.7 s for a float16 step of this MLP, 7 ms in bfloat16),
   which would hide any overhead, while the loss-scaling work (float32
   variables and gradients, the same scale, check, skip and update) is the
   same in both.
4. The barrier: plain SGD made to wait until every gradient is known before
   its first update, as any skip decision must. Its overhead is the part of
   (3) no exact loss scaling can avoid. Then tf_lossscale with parts taken
   away, to show where the rest goes: the unscale alone, then the unscale
   with the scale's update and the skip branch (the check replaced by a flag
   that costs nothing).
5. `model.fit` of the same MLP compiled with XLA (`jit_compile=True`, Keras'
   default on GPUs), in its own interleaved rounds: no loss scaling, Keras
   3's wrapper, and tf_lossscale as users run it there, with no callback
   (the default loss scale needs no watcher under XLA and reads nothing per
   call).

Run: python benchmarks/loss_scale_benchmark.py [--quick] [--rounds=N]
     [--fit_steps=N] [--fit_rounds=N]
"""

import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np
import tensorflow as tf

import tf_lossscale
from tf_lossscale import distribution

tf.get_logger().setLevel("ERROR")  # TF's reference is deprecated; it says so.

_SEED = 0
_SCALE = 2.0 ** 15

# Targets (ratios), as restated by issue 16.
_TARGET_VS_REFERENCE = 0.85
_TARGET_CHECK_VS_BARE = 0.5  # On large gradients only.
_TARGET_APPLY_VS_KERAS = 0.9
_TARGET_FIT_OVERHEAD_SHARE = 0.5
_TARGET_MONITOR_SHARE = 0.01
_TARGET_XLA_FIT_OVERHEAD_SHARE = 1.0


def _resnet50_shapes(width=1):
    """The trainable shapes of ResNet-50 (161 tensors, 25.5M values at
    width 1): conv kernels, batch-norm scales and offsets, the classifier."""
    shapes = [(7, 7, 3, 64 // width), (64 // width,), (64 // width,)]
    channels = 64 // width
    for blocks, mid, out in ((3, 64, 256), (4, 128, 512), (6, 256, 1024),
                             (3, 512, 2048)):
        mid, out = mid // width, out // width
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
        return {"ResNet-50-like /16, first 12": _resnet50_shapes(16)[:12],
                "20 x 100": [(100,)] * 20,
                "2 x 64K": [(65536,)] * 2}
    return {"ResNet-50-like": _resnet50_shapes(),
            "1000 x 1000": [(1000,)] * 1000,
            "4 x 8M": [(8_000_000,)] * 4}


def is_large(shapes):
    """Large gradients: over 10,000 values per tensor on average (the
    ResNet-50-like and 4 x 8M sets; in quick mode, 2 x 64K)."""
    total = sum(int(np.prod(s)) for s in shapes)
    return total / len(shapes) > 10_000


def _constants(shapes):
    rng = np.random.default_rng(_SEED)
    # Scaled gradients: unit-size values times the scale.
    return [tf.constant(rng.standard_normal(s).astype(np.float32) * _SCALE)
            for s in shapes]


def interleaved(candidates, rounds, calls):
    """Times each candidate in interleaved rounds; returns name -> samples
    of seconds per call."""
    for fn in candidates.values():
        fn()  # Trace and warm up outside the measurement.
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return samples


def _medians(samples):
    return {name: statistics.median(s) for name, s in samples.items()}


class Report:
    """Collects target verdicts while printing."""

    def __init__(self, out):
        self.out = out
        self.verdicts = []

    def line(self, text=""):
        print(text, file=self.out, flush=True)

    def target(self, description, value, limit, higher_is_better=False):
        holds = value >= limit if higher_is_better else value <= limit
        self.verdicts.append((description, holds))
        relation = ">=" if higher_is_better else "<="
        self.line(f"    target {description}: {value:.3f} {relation} "
                  f"{limit:.3f} -> {'HOLDS' if holds else 'MISSED'}")


def _ratios(report, medians, baseline):
    for name, seconds in medians.items():
        report.line(f"  {name:<40} x{seconds / medians[baseline]:.3f}")


# ---------------------------------------------------------------------------
# 1. Check + unscale + update.


def check_unscale_update(report, sets, rounds, calls):
    report.line("\n1. Check + unscale + update (ratios to the bare unscale)")
    for set_name, shapes in sets.items():
        grads = _constants(shapes)
        keras_wrapper = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(), initial_scale=_SCALE)
        keras_wrapper.build([tf.Variable(tf.zeros([1]))])
        reference = tf.compat.v1.mixed_precision.DynamicLossScale(
            _SCALE, increment_period=10 ** 9)
        ours = tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(), loss_scale=tf_lossscale.DynamicLossScale(
                _SCALE, increment_period=10 ** 9))
        scale = tf.Variable(_SCALE)

        @tf.function
        def bare():
            inverse = 1.0 / scale
            return [g * inverse for g in grads]

        @tf.function
        def keras_check_divide():
            finite = keras_wrapper.check_finite(grads)
            divisor = keras_wrapper.dynamic_scale
            return [g / divisor for g in grads], finite

        @tf.function
        def tf_reference():
            divisor = reference()
            unscaled = [g / divisor for g in grads]
            return unscaled, reference.update(unscaled)[1]

        @tf.function
        def tf_lossscale_tf2():
            unscaled = ours.get_unscaled_gradients(grads)
            return unscaled, ours.loss_scale.update(unscaled)[1]

        @tf.function
        def tf_lossscale_check():
            return ours.check_finite(grads)

        medians = _medians(interleaved({
            "bare unscale": bare,
            "Keras 3 check_finite + divide": keras_check_divide,
            "TF reference (divide + update)": tf_reference,
            "tf_lossscale (TF2 protocol)": tf_lossscale_tf2,
            "tf_lossscale check alone": tf_lossscale_check,
        }, rounds, calls))
        total = sum(int(np.prod(s)) for s in shapes)
        report.line(f"\n  {set_name}: {len(shapes)} tensors, {total:,} values")
        _ratios(report, medians, "bare unscale")
        ours_time = medians["tf_lossscale (TF2 protocol)"]
        faster = min(medians["Keras 3 check_finite + divide"],
                     medians["TF reference (divide + update)"])
        report.target(f"{set_name}: tf_lossscale / faster reference",
                      ours_time / faster, _TARGET_VS_REFERENCE)
        if is_large(shapes):
            report.target(
                f"{set_name}: tf_lossscale's check alone / bare unscale",
                medians["tf_lossscale check alone"] / medians["bare unscale"],
                _TARGET_CHECK_VS_BARE)


# ---------------------------------------------------------------------------
# 2. The Keras-protocol apply path.


def apply_path(report, sets, rounds, calls):
    report.line("\n2. Keras-protocol apply with SGD (ratios to Keras 3's)")
    for set_name, shapes in sets.items():
        grads = _constants(shapes)

        def variables():
            return [tf.Variable(tf.zeros(s)) for s in shapes]

        ours_vars, keras_vars, bare_vars = variables(), variables(), variables()
        ours = tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(1e-9), loss_scale=tf_lossscale.DynamicLossScale(
                _SCALE, increment_period=10 ** 9))
        keras_wrapper = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(1e-9), initial_scale=_SCALE,
            dynamic_growth_steps=10 ** 9)
        bare_sgd = keras.optimizers.SGD(1e-9)
        scale = tf.Variable(_SCALE)
        ours.scale_loss(tf.constant(1.0))  # The Keras 3 protocol.

        @tf.function
        def ours_apply():
            ours.apply(grads, ours_vars)

        @tf.function
        def keras_apply():
            keras_wrapper.apply(grads, keras_vars)

        @tf.function
        def bare_apply():
            inverse = 1.0 / scale
            bare_sgd.apply([g * inverse for g in grads], bare_vars)

        medians = _medians(interleaved({
            "Keras 3 LossScaleOptimizer.apply": keras_apply,
            "tf_lossscale LossScaleOptimizer.apply": ours_apply,
            "bare SGD.apply(g * 1/scale)": bare_apply,
        }, rounds, calls))
        report.line(f"\n  {set_name}")
        _ratios(report, medians, "Keras 3 LossScaleOptimizer.apply")
        report.target(
            f"{set_name}: apply path / Keras 3's",
            medians["tf_lossscale LossScaleOptimizer.apply"]
            / medians["Keras 3 LossScaleOptimizer.apply"],
            _TARGET_APPLY_VS_KERAS)
        del ours_vars, keras_vars, bare_vars


# ---------------------------------------------------------------------------
# 3 and 4. model.fit.


class _BarrierSGD(keras.optimizers.SGD):
    """SGD that waits for every gradient before its first update."""

    def __init__(self, learning_rate):
        super().__init__(learning_rate, name="barrier_sgd")

    def apply(self, grads, trainable_variables=None):
        grads = tf.identity_n(list(grads))
        return super().apply(grads, trainable_variables)


class UnscaleOnlyAblation(tf_lossscale.LossScaleOptimizer):
    """Ablation: the unscale, then straight to the inner optimizer."""

    def _apply_if_all_finite(self, grads, trainable_variables):
        distribution.call_for_each_replica(
            self.inner_optimizer.apply, grads, trainable_variables)


class NoCheckAblation(tf_lossscale.LossScaleOptimizer):
    """Ablation: everything but the finiteness check."""

    def check_finite(self, grads):
        # Read from the scale, so that the branch cannot be folded away.
        return tf.math.is_finite(self.loss_scale())


def _mlp(width):
    keras.utils.set_random_seed(_SEED)
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(6)]
        + [keras.layers.Dense(10, dtype="float32")])


def _fit_candidates(width, jit_compile=False):
    def plain(optimizer_class=keras.optimizers.SGD):
        def make():
            model = _mlp(width)
            model.compile(optimizer=optimizer_class(0.01),
                          loss="sparse_categorical_crossentropy",
                          auto_scale_loss=False, jit_compile=jit_compile)
            return model, []
        return make

    def wrapped(wrapper, callbacks=()):
        def make():
            model = _mlp(width)
            model.compile(optimizer=wrapper(keras.optimizers.SGD(0.01)),
                          loss="sparse_categorical_crossentropy",
                          jit_compile=jit_compile)
            return model, [c() for c in callbacks]
        return make

    if jit_compile:
        return {
            "no loss scaling": plain(),
            "Keras 3 LossScaleOptimizer": wrapped(
                keras.optimizers.LossScaleOptimizer),
            "tf_lossscale": wrapped(tf_lossscale.LossScaleOptimizer),
        }
    return {
        "no loss scaling": plain(),
        "barrier only (SGD waits for all grads)": plain(_BarrierSGD),
        "Keras 3 LossScaleOptimizer": wrapped(
            keras.optimizers.LossScaleOptimizer),
        "tf_lossscale": wrapped(tf_lossscale.LossScaleOptimizer),
        "tf_lossscale + LossScaleMonitor": wrapped(
            tf_lossscale.LossScaleOptimizer, [tf_lossscale.LossScaleMonitor]),
        "tf_lossscale, unscale only": wrapped(UnscaleOnlyAblation),
        "tf_lossscale without the check": wrapped(NoCheckAblation),
    }


def _fit_data(steps, width, batch_size):
    rng = np.random.default_rng(_SEED)
    x = rng.standard_normal((steps * batch_size, width)).astype(np.float32)
    return x, rng.integers(0, 10, steps * batch_size)


def _make_runs(candidates):
    """Builds each candidate's model under mixed_bfloat16."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        with warnings.catch_warnings():
            # tf_lossscale warns that bfloat16 needs no scaling: here the
            # scaling is what is measured.
            warnings.simplefilter("ignore", UserWarning)
            return {name: make() for name, make in candidates.items()}
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _interleaved_fits(report, runs, x, y, batch_size, rounds):
    """Fits every run once per round, interleaved; prints and returns the
    median per-round CPU-time ratio to "no loss scaling"."""

    def fit(name):
        model, callbacks = runs[name]
        cpu, wall = time.process_time(), time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0,
                  shuffle=False, callbacks=callbacks)
        return time.process_time() - cpu, time.perf_counter() - wall

    for name in runs:
        fit(name)  # Trace and warm up.
    cpu_ratios = {name: [] for name in runs}
    wall_ratios = {name: [] for name in runs}
    for _ in range(rounds):
        times = {name: fit(name) for name in runs}
        base_cpu, base_wall = times["no loss scaling"]
        for name, (cpu, wall) in times.items():
            cpu_ratios[name].append(cpu / base_cpu)
            wall_ratios[name].append(wall / base_wall)
    cpu = _medians(cpu_ratios)
    wall = _medians(wall_ratios)
    report.line(f"  {'':<42} {'CPU time':>9} {'wall time':>10}"
                "   (median per-round ratio to no loss scaling)")
    for name in runs:
        report.line(f"  {name:<42} x{cpu[name]:.3f}   x{wall[name]:.3f}")
    return cpu


def _fit_overheads(report, title, candidates, x, y, batch_size, rounds,
                   what, target_label, target_share):
    """Interleaved fits of `candidates`; prints ours and Keras 3's overhead
    over no loss scaling and the target. Returns (cpu ratios, ours, theirs)."""
    report.line(title)
    cpu = _interleaved_fits(report, _make_runs(candidates), x, y, batch_size,
                            rounds)
    ours = cpu["tf_lossscale"] - 1.0
    theirs = cpu["Keras 3 LossScaleOptimizer"] - 1.0
    report.line(f"  CPU overhead over no loss scaling{what}: tf_lossscale "
                f"{ours:+.3f}, Keras 3 {theirs:+.3f}")
    report.target(target_label, ours, target_share * theirs)
    return cpu, ours, theirs


def xla_fit_overhead(report, rounds, steps, width=512, batch_size=128):
    x, y = _fit_data(steps, width, batch_size)
    _fit_overheads(
        report, f"\n5. model.fit of the same 6x{width} MLP under XLA "
        f"(jit_compile=True), mixed_bfloat16, batch {batch_size}, {steps} "
        "steps per run", _fit_candidates(width, jit_compile=True), x, y,
        batch_size, rounds, " under XLA",
        "XLA fit CPU overhead: tf_lossscale's (vs Keras 3's)",
        _TARGET_XLA_FIT_OVERHEAD_SHARE)


def fit_overhead(report, rounds, steps, width=512, batch_size=128):
    x, y = _fit_data(steps, width, batch_size)
    cpu, ours, theirs = _fit_overheads(
        report, f"\n3. model.fit of a 6x{width} MLP, mixed_bfloat16 compute "
        f"(see the module docstring), batch {batch_size}, {steps} steps per "
        "run", _fit_candidates(width), x, y, batch_size, rounds, "",
        "fit CPU overhead: tf_lossscale's (vs half of Keras 3's)",
        _TARGET_FIT_OVERHEAD_SHARE)
    monitor = cpu["tf_lossscale + LossScaleMonitor"] - cpu["tf_lossscale"]
    report.line(f"  LossScaleMonitor adds {monitor:+.3f} of an unscaled step")
    report.target("LossScaleMonitor's cost per fit step (vs 1%)", monitor,
                  _TARGET_MONITOR_SHARE)

    barrier = cpu["barrier only (SGD waits for all grads)"] - 1.0
    report.line("\n4. The barrier: every gradient known before the first "
                "update")
    report.line(f"  barrier alone: {barrier:+.3f} of an unscaled step (CPU); "
                f"tf_lossscale: {ours:+.3f}; Keras 3: {theirs:+.3f}")
    report.line(f"  beyond the barrier: tf_lossscale {ours - barrier:+.3f}, "
                f"Keras 3 {theirs - barrier:+.3f}")
    unscale = cpu["tf_lossscale, unscale only"] - 1.0
    no_check = cpu["tf_lossscale without the check"] - 1.0
    report.line(f"  tf_lossscale by parts: the unscale {unscale:+.3f}; the "
                f"update and the skip branch {no_check - unscale:+.3f}; the "
                f"check {ours - no_check:+.3f}")


def run(quick=False, rounds=None, fit_steps=None, fit_rounds=None,
        out=sys.stdout):
    """Runs every measurement; returns [(target, holds)].

    `quick` uses small gradient sets, a 6x16 MLP and one round: it checks
    that the benchmark runs, its figures mean nothing.
    """
    report = Report(out)
    keras.mixed_precision.set_global_policy("mixed_float16")
    rounds = rounds or (1 if quick else 15)
    calls = 1 if quick else 5
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    report.line(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
                f"{os.cpu_count()} CPUs, load average {load:.2f}; median of "
                f"{rounds} interleaved rounds{' (quick)' if quick else ''}")
    sets = gradient_sets(quick)
    check_unscale_update(report, sets, rounds, calls)
    apply_path(report, sets, rounds, calls)
    fit_args = dict(rounds=fit_rounds or (1 if quick else 9),
                    steps=fit_steps or (2 if quick else 60),
                    width=16 if quick else 512,
                    batch_size=16 if quick else 128)
    fit_overhead(report, **fit_args)
    xla_fit_overhead(report, **fit_args)
    held = sum(holds for _, holds in report.verdicts)
    report.line(f"\nTargets holding: {held} of {len(report.verdicts)}")
    for description, holds in report.verdicts:
        report.line(f"  [{'x' if holds else ' '}] {description}")
    return report.verdicts


def main(argv):
    options = {}
    for arg in argv:
        if arg == "--quick":
            options["quick"] = True
        elif arg.split("=")[0] in ("--rounds", "--fit_steps", "--fit_rounds"):
            options[arg.split("=")[0][2:]] = int(arg.split("=", 1)[1])
        else:
            raise SystemExit(f"unknown argument {arg!r}; use --quick, "
                             "--rounds=N, --fit_steps=N, --fit_rounds=N")
    run(**options)


if __name__ == "__main__":
    main(sys.argv[1:])

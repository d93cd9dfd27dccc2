"""What `tf_lossscale.diagnose` and `Float16Diagnosis.fix` cost.

On keras.applications' ResNet50 (25.6M weights; 32x32 inputs, batch 16, 10
classes, built under mixed_float16 as users build it; a 2-layer conv net
with `--quick`): `diagnose` at a few numbers of batches (`steps`) and of
probed scales, then `fix` of one report, each timed once (wall and process
CPU time), beside a `fit` training step of the same model measured in the
same run, so that each cost also reads as training steps' worth.

What a diagnosis costs is `copies + compile + passes x pass`: rebuilding a
float32 twin and a float16 copy of the model; tracing and compiling their
two passes (the first batch); then, per batch, one float32 pass and one
float16 pass per scale up to the first that overflows (the scales above it
are not run). The `steps=1, 1 scale` row is the fixed part; `passes` counts
the passes run. No target: the guide gives the figures.
"""

import time

import keras
import numpy as np

import tf_lossscale

NAME = "diagnosis"
TITLE = "diagnose and fix, ResNet-50 (32x32, batch 16, mixed_float16)"

_BATCH = 16


def _model(quick):
    keras.utils.set_random_seed(0)
    if quick:
        inputs = keras.Input((32, 32, 3))
        h = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
        h = keras.layers.GlobalAveragePooling2D()(
            keras.layers.BatchNormalization()(h))
        logits = keras.layers.Dense(10)(h)
    else:
        base = keras.applications.ResNet50(
            input_shape=(32, 32, 3), weights=None, classes=10,
            classifier_activation=None)
        inputs, logits = base.input, base.output
    outputs = keras.layers.Activation("softmax", dtype="float32")(logits)
    model = keras.Model(inputs, outputs)
    model.compile(tf_lossscale.LossScaleOptimizer(keras.optimizers.Adam()),
                  "sparse_categorical_crossentropy")
    return model


def _data(batches):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((_BATCH, 32, 32, 3)).astype(np.float32),
             rng.integers(0, 10, _BATCH)) for _ in range(batches)]


def _timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _passes(report):
    """The passes a diagnosis ran: per batch a float32 one, and a float16
    one per scale up to the batch's first overflow."""
    figures = report.as_dict()
    batches, overflow = figures["batches"], figures["overflow_batches"]
    return batches + batches + sum(batches - n for n in overflow[:-1])


def run(context):
    report, quick = context.report, context.settings.quick
    report.line(f"\n{NAME}: {TITLE}")
    model = _model(quick)
    data = _data(1 if quick else 4)
    x = np.concatenate([b[0] for b in data])
    y = np.concatenate([b[1] for b in data])
    model.train_on_batch(x[:_BATCH], y[:_BATCH])  # Traced and compiled.
    steps = []
    for _ in range(1 if quick else 5):
        _, wall, _ = _timed(lambda: model.train_on_batch(x[:_BATCH],
                                                         y[:_BATCH]))
        steps.append(wall)
    step = float(np.median(steps))
    report.line(f"  a fit training step: {step:.3f} s (median of "
                f"{len(steps)})")
    every = [2.0**k for k in range(33)]
    configs = [(1, [1.0])] + ([] if quick else [
        (2, every), (4, every), (2, every[::2]), (2, every[::4])])
    table = report.table(f"{TITLE}: time, and training steps' worth", [
        "run", "passes", "wall (s)", "CPU (s)", "training steps"])
    results = {}
    for count, scales in configs:
        diagnosis, wall, cpu = _timed(lambda c=count, s=scales: (
            tf_lossscale.diagnose(model, data[:c], scales=s, verbose=0)))
        name = f"diagnose, steps={count}, {len(scales)} scales"
        table.add(name, _passes(diagnosis), f"{wall:.1f}", f"{cpu:.1f}",
                  f"{wall / step:.0f}")
        results[name] = wall
    fixed, wall, cpu = _timed(lambda: diagnosis.fix(model))
    table.add(f"fix of the last ({fixed.name})", "-", f"{wall:.1f}",
              f"{cpu:.1f}", f"{wall / step:.0f}")
    results["fix"] = wall
    report.show(table)
    return results

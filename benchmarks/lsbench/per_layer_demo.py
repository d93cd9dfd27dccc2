"""The demonstration model of per-layer scaling: no single loss scale fits it.

Two tanh layers ("low_1", "low_2") get their gradient through `GradientGain`
(forward the identity, backward times 2**-38, in float32: a stand-in for a
block behind a gradient multiplier, as fairseq's GradMultiply, or deep in a
network whose gradients vanish), then a relu layer ("high") and the output
("head"). The low layers' gradients are ~2**-38 of the others': at any loss
scale the head's gradients allow, they are below float16's smallest
subnormal. Adam is scale-free (epsilon tiny), so float32 trains them as if
the gain were 1. The task: y = sum(sin(x W)) for a fixed W, 16 features.

`runs(steps)` trains it four ways from the same weights and data: float32;
mixed_float16 with the default dynamic loss scale; with a fixed scale at the
top of the range the diagnosis advises (the best single scale); and scaled
per layer, with segments where the diagnosis finds the gradients'
magnitudes parting. `shares` diagnoses the model and its per-layer copy.
"""

import time
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale
from tf_lossscale import layerwise

LOG2_GAIN = -38.0
FEATURES = 16
BATCH = 64
SEED = 1


@keras.saving.register_keras_serializable(package="lsbench")
class GradientGain(keras.layers.Layer):
    """Forward the identity; backward the gradient times 2**log2_gain."""

    def __init__(self, log2_gain, **kwargs):
        super().__init__(**kwargs)
        self.log2_gain = float(log2_gain)

    def call(self, inputs):
        gain = 2.0 ** self.log2_gain

        @tf.custom_gradient
        def scaled(x):
            return tf.identity(x), lambda dy: dy * tf.cast(gain, dy.dtype)

        return scaled(inputs)

    def get_config(self):
        return {**super().get_config(), "log2_gain": self.log2_gain}


def data(examples=2048):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((examples, FEATURES)).astype(np.float32)
    w = (rng.standard_normal((FEATURES, 4)) / 2).astype(np.float32)
    y = np.sin(x @ w).sum(axis=1, keepdims=True).astype(np.float32)
    return x, y


def model(policy, width=32, loss_scale="dynamic"):
    """The compiled model (Adam(3e-3, epsilon=1e-30), mean squared error);
    the same weights for every policy."""
    keras.utils.set_random_seed(SEED)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(width, activation="tanh", dtype=policy,
                           name="low_1")(x)
    h = keras.layers.Dense(width, activation="tanh", dtype=policy,
                           name="low_2")(h)
    h = GradientGain(LOG2_GAIN, dtype="float32", name="gain")(h)
    h = keras.layers.Dense(width, activation="relu", dtype=policy,
                           name="high")(h)
    out = keras.layers.Dense(1, dtype="float32", name="head")(h)
    built = keras.Model(x, out, name="demonstration")
    inner = keras.optimizers.Adam(3e-3, epsilon=1e-30)
    built.compile(inner if policy == "float32" else
                  tf_lossscale.LossScaleOptimizer(inner, loss_scale), "mse")
    return built


class Run(NamedTuple):
    losses: list  # The mean loss of each of `points` equal parts of the run.
    seconds: float
    scale: float  # The loss scale at the end (None in float32).
    skipped: int
    factors: dict  # Per-layer runs: {segment: F} at the end.


def _fit(compiled, x, y, steps, points):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)
    start = time.perf_counter()
    history = compiled.fit(dataset, steps_per_epoch=steps // points,
                           epochs=points, verbose=0, shuffle=False)
    seconds = time.perf_counter() - start
    optimizer = compiled.optimizer
    wrapped = isinstance(optimizer, tf_lossscale.LossScaleOptimizer)
    return Run(history.history["loss"], seconds,
               float(optimizer.loss_scale()) if wrapped else None,
               int(optimizer.skipped_steps) if wrapped else 0,
               compiled.gradient_factors()
               if isinstance(compiled, layerwise.LayerwiseModel) else {})


def _batches(examples):
    x, y = data()
    return [(x[i:i + BATCH], y[i:i + BATCH])
            for i in range(0, examples, BATCH)]


def best_single_scale(width=32, examples=256, scales=None):
    """The top of the loss-scale range `diagnose` advises for the model, and
    its report (on `examples` examples, at `scales`: by default diagnose's)."""
    batches = _batches(examples)
    extra = {} if scales is None else {"scales": scales}
    report = tf_lossscale.diagnose(model("mixed_float16", width), batches,
                                   steps=len(batches), **extra)
    return report.loss_scale_range[1], report


def runs(steps=300, points=10, width=32, examples=256, scales=None):
    """{name: Run} of the four trainings, the diagnosis of the model (on
    `examples` examples, at `scales`), and the trained models."""
    x, y = data()
    best, report = best_single_scale(width, examples, scales)
    fixed = tf_lossscale.FixedLossScale(best, skip_non_finite=True)
    trained = {
        "float32": model("float32", width),
        "single scale (dynamic)": model("mixed_float16", width),
        f"single scale (fixed 2^{np.log2(best):.0f})": model(
            "mixed_float16", width, loss_scale=fixed),
        # Segments where the diagnosis finds the magnitudes parting.
        "per-layer scaling": layerwise.scale_per_layer(
            model("mixed_float16", width),
            segments=report.gradient_maxima()),
    }
    results = {name: _fit(compiled, x, y, steps, points)
               for name, compiled in trained.items()}
    return results, report, trained


def underflow_shares(compiled, scale, examples=256):
    """{variable: share of its gradient's nonzero values float16 loses at
    loss scale `scale`}, as `diagnose` measures it (`compiled` as it is:
    for a per-layer model, its factors)."""
    batches = _batches(examples)
    report = tf_lossscale.diagnose(compiled, batches, steps=len(batches),
                                   scales=[float(scale)])
    return {row["name"]: row["underflow_share"][0]
            for row in report.as_dict()["variables"]
            if row["underflow_share"] is not None}

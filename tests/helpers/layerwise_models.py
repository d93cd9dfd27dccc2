"""Tiny Keras 3 models for the per-layer scaling tests (`tests/layerwise/`).

* `gained_model`: two tanh layers ("low_1", "low_2") whose gradient reaches
  them through `GradientGain` (forward the identity, backward times
  2**log2_gain, in float32), then "high" (relu) and "head": with the default
  gain of 2**-38 no single loss scale keeps the low layers' gradients in
  float16, and Adam (scale-free; `epsilon` tiny) still trains them in
  float32. The smaller twin of the benchmark's demonstration model.
* `branched_model`: a functional model with a residual Add, a nested
  Sequential block and a layer called twice.
* `data`: inputs and a learnable target for them.
"""

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale

FEATURES = 4
BATCH = 8


@keras.saving.register_keras_serializable(package="tests")
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


def data(batches=4, seed=0, nan_batches=()):
    """`(x, y)`: `batches` of `BATCH` examples, y a smooth function of x;
    a NaN in the first example of each of `nan_batches`."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batches * BATCH, FEATURES)).astype(np.float32)
    y = np.sin(x @ np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32))[
        :, None].astype(np.float32)
    for batch in nan_batches:
        x[batch * BATCH, 0] = np.nan
    return x, y


def adam():
    # Tiny epsilon: gradients of 2**-40 must move the float32 run.
    return keras.optimizers.Adam(0.01, epsilon=1e-30)


def gained_model(policy="mixed_float16", log2_gain=-38.0, seed=0,
                 loss_scale="dynamic", optimizer=adam, **compile_args):
    """The compiled gained model (see the module docstring)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(8, activation="tanh", dtype=policy,
                           name="low_1")(x)
    h = keras.layers.Dense(8, activation="tanh", dtype=policy,
                           name="low_2")(h)
    h = GradientGain(log2_gain, dtype="float32", name="gain")(h)
    h = keras.layers.Dense(8, activation="relu", dtype=policy,
                           name="high")(h)
    out = keras.layers.Dense(1, dtype="float32", name="head")(h)
    model = keras.Model(x, out, name="gained")
    model.compile(tf_lossscale.LossScaleOptimizer(optimizer(), loss_scale),
                  "mse", **compile_args)
    return model


def branched_model(policy="mixed_float16", seed=0):
    """A compiled functional model: a nested Sequential "block", a residual
    Add, and "shared" called twice."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(6, activation="relu", dtype=policy,
                           name="stem")(x)
    block = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(6, activation="relu", dtype=policy),
        keras.layers.Dense(6, dtype=policy)], name="block")
    h = keras.layers.Add(dtype=policy, name="residual")([h, block(h)])
    shared = keras.layers.Dense(6, activation="tanh", dtype=policy,
                                name="shared")
    h = shared(shared(h))
    out = keras.layers.Dense(1, dtype="float32", name="head")(h)
    model = keras.Model(x, out, name="branched")
    model.compile(tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.05)), "mse", metrics=["mae"])
    return model

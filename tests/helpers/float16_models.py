"""Tiny models built to fail in float16 in known ways, and their data.

For the float16 diagnosis tests, with Keras 3
(`tests/diagnosis/test_diagnosis.py`) and with tf-keras
(`tests/scripts/tf_keras_float16_diagnosis.py`): each builder takes the Keras
module to build with.

* `overflowing_model`: layer "boom" multiplies its inputs by 10**4, so its
  outputs exceed float16's 65504: the forward pass overflows there.
* `underflowing_model`: the output layer's kernel is ~1e-3 and the targets
  are tiny, so at loss scale 1 the hidden layer's gradients fall below
  float16's subnormal range (~6e-8) and flush to 0.
* `normalized_model`: layer "boom" overflows float16 as above, but a
  LayerNormalization ("norm") brings its outputs back into range before the
  float16 layers after it.
* `healthy_model`: a small Sequential classifier that float16 holds.
"""

import numpy as np

FEATURES = 8
BATCH = 16
BATCHES = 4


def inputs(seed=0, batches=BATCHES):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batches * BATCH, FEATURES)).astype(np.float32)


def batches(x, y):
    """`(x, y)` as a list of `BATCH`-sized batches."""
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


def overflowing_model(keras, seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(16, activation="relu", dtype="mixed_float16",
                           name="ok")(x)
    h = keras.layers.Dense(
        16, dtype="mixed_float16", name="boom",
        kernel_initializer=keras.initializers.Constant(1e4))(h)
    h = keras.layers.Dense(4, dtype="mixed_float16", name="after")(h)
    probabilities = keras.layers.Activation(
        "softmax", dtype="float32", name="probabilities")(h)
    model = keras.Model(x, probabilities, name="overflowing")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def normalized_model(keras, seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(16, activation="relu", dtype="mixed_float16",
                           name="ok")(x)
    h = keras.layers.Dense(
        16, dtype="mixed_float16", name="boom",
        kernel_initializer=keras.initializers.RandomNormal(stddev=3e4,
                                                           seed=seed))(h)
    h = keras.layers.LayerNormalization(dtype="mixed_float16", name="norm")(h)
    h = keras.layers.Dense(16, activation="relu", dtype="mixed_float16",
                           name="after")(h)
    h = keras.layers.Dense(4, dtype="mixed_float16", name="logits")(h)
    probabilities = keras.layers.Activation(
        "softmax", dtype="float32", name="probabilities")(h)
    model = keras.Model(x, probabilities, name="normalized")
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def healthy_model(keras, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16, activation="relu", dtype="mixed_float16",
                           name="hidden"),
        keras.layers.Dense(4, dtype="mixed_float16", name="logits"),
        keras.layers.Activation("softmax", dtype="float32",
                                name="probabilities"),
    ], name="healthy")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def overflowing_data(seed=0):
    x = inputs(seed)
    y = np.random.default_rng(seed + 1).integers(0, 4, len(x))
    return batches(x, y)


def underflowing_model(keras, seed=0, optimizer="sgd"):
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(32, activation="relu", dtype="mixed_float16",
                           name="hidden")(x)
    out = keras.layers.Dense(
        1, dtype="mixed_float16", name="out",
        kernel_initializer=keras.initializers.RandomNormal(
            stddev=1e-3, seed=seed))(h)
    model = keras.Model(x, out, name="underflowing")
    model.compile(optimizer=optimizer, loss="mse")
    return model


def underflowing_targets(x):
    return (1e-3 * x.sum(axis=1, keepdims=True)).astype(np.float32)


def underflowing_data(seed=0):
    x = inputs(seed)
    return batches(x, underflowing_targets(x))


def float32_copy(keras, model):
    """The same layers as `model` built anew in float32 by hand (not from
    its config), with its weights."""
    rebuilt = keras.Sequential(
        [keras.Input((FEATURES,))] + [
            keras.layers.Dense(layer.units, activation=layer.activation,
                               dtype="float32")
            for layer in model.layers if hasattr(layer, "units")])
    rebuilt.set_weights(model.get_weights())
    return rebuilt


def underflow_cost(scaled_float16, float32, scale, layer_float32):
    """The diagnosis' measure of what float16 underflow loses of a gradient,
    computed here: the smaller of the share of `float32`'s nonzero values
    whose float16 counterparts at loss scale `scale` (`scaled_float16`) are
    zero or subnormal, and the share of the norm of the layer's float32
    gradient (`layer_float32`, a list of arrays) that those lose."""
    lost = (np.abs(scaled_float16) < 2.0**-14) & (float32 != 0)
    values = lost.sum() / (float32 != 0).sum()
    difference = np.where(lost, float32.astype(np.float64)
                          - scaled_float16.astype(np.float64) / scale, 0.0)
    norm = np.sqrt(np.sum(difference**2) / sum(
        np.sum(np.asarray(g, np.float64)**2) for g in layer_float32))
    return min(values, norm)

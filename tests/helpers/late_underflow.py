"""A tiny Keras 3 model whose lower layers' gradients drift below float16's
range as it trains, while its top's grow: a late failure whose answer is
per-layer scaling (`tests/watch/test_per_layer.py`).

`DriftingGain` is a planted stand-in for what moving weights do to
gradients in deep models (a part of the network whose gradients shrink by
orders of magnitude over training while another's grow): forward the
identity, backward the gradient times 2**(log2_gain + rate * t), t the
training calls so far up to `until` (a weight, saved and copied with the
others): the drift stops there, as a run's magnitudes level off. Below
"low_1"/"low_2" the gain shrinks; above "high" it grows, so the loss scale
must come down to keep "high"'s float16 gradients finite, and at the scale
it comes down to, the low layers' gradients are lost to underflow. Adam
(scale-free, `epsilon` tiny) trains the float32 run whatever the gains.
"""

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale
from tests.helpers import layerwise_models

FEATURES, BATCH = layerwise_models.FEATURES, layerwise_models.BATCH


@keras.saving.register_keras_serializable(package="tests")
class DriftingGain(keras.layers.Layer):
    """Forward the identity; backward the gradient times
    2**(log2_gain + rate * t), t the training calls so far, at most
    `until`."""

    def __init__(self, log2_gain, rate, until, **kwargs):
        super().__init__(**kwargs)
        self.log2_gain, self.rate = float(log2_gain), float(rate)
        self.until = float(until)
        self.calls = self.add_weight(shape=(), initializer="zeros",
                                     trainable=False, name="calls",
                                     dtype="float32", autocast=False)

    def call(self, inputs, training=False):
        gain = 2.0 ** (self.log2_gain + self.rate * tf.minimum(
            tf.convert_to_tensor(self.calls), self.until))
        if training:
            self.calls.assign_add(1.0)

        @tf.custom_gradient
        def scaled(x):
            return tf.identity(x), lambda dy: dy * tf.cast(gain, dy.dtype)

        return scaled(inputs)

    def get_config(self):
        return {**super().get_config(), "log2_gain": self.log2_gain,
                "rate": self.rate, "until": self.until}


def drifting_model(policy="mixed_float16", seed=0, shrink=-0.15, grow=0.05,
                   until=170, scaled=False):
    """The compiled model (see the module docstring), with a dynamic loss
    scale; `scaled`: scaled per layer at "low_1" and "high"."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((FEATURES,))
    h = keras.layers.Dense(8, activation="tanh", dtype=policy,
                           name="low_1")(x)
    h = keras.layers.Dense(8, activation="tanh", dtype=policy,
                           name="low_2")(h)
    h = DriftingGain(-10.0, shrink, until, dtype="float32", name="shrink")(h)
    h = keras.layers.Dense(8, activation="relu", dtype=policy,
                           name="high")(h)
    h = DriftingGain(0.0, grow, until, dtype="float32", name="grow")(h)
    out = keras.layers.Dense(1, dtype="float32", name="head")(h)
    model = keras.Model(x, out, name="drifting")
    model.compile(tf_lossscale.LossScaleOptimizer(layerwise_models.adam()),
                  "mse")
    if scaled:
        model = tf_lossscale.layerwise.scale_per_layer(
            model, segments=["low_1", "high"])
    return model


def data(batches=8, seed=0):
    return layerwise_models.data(batches, seed)

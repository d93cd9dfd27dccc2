"""`GradientScaling`: the layer at a segment boundary of a scaled model
(docs/guides/per-layer-scaling.md, "What it does")."""

import keras
import tensorflow as tf


def _rescaled_backward(x, ratio):
    """`x`; its gradient is multiplied by `ratio` (a float32 scalar)."""

    # `ratio` is closed over, not an input: a gradient for it would be
    # zeros the tape builds and nobody reads.
    @tf.custom_gradient
    def rescaled(x):
        def grad(upstream):
            wide = tf.cast(upstream, tf.float32) * ratio
            return tf.cast(wide, upstream.dtype)

        return x, grad

    return rescaled(x)


@keras.saving.register_keras_serializable(package="tf_lossscale")
class GradientScaling(keras.layers.Layer):
    """Identity forward; backward, the gradient times F_producer / F_consumer
    (in float32, before the layer's dtype rounds it).

    Made by `tf_lossscale.layerwise.scale_per_layer`, which puts one on every
    edge of the model's graph between two segments; the ratio is the
    `LayerwiseModel`'s, bound to the layer when that model is made. Unbound
    (in a model of another class) its gradient passes unchanged.

    Args:
      producer: the index of the segment whose output comes in.
      consumer: the index of the segment the output goes to.
      **kwargs: Keras layer arguments (`name`, `dtype`).
    """

    def __init__(self, producer, consumer, **kwargs):
        super().__init__(**kwargs)
        self.producer = int(producer)
        self.consumer = int(consumer)
        self.supports_masking = True
        # Not tracked: the factors are the model's variables, saved there.
        object.__setattr__(self, "_ratio", None)

    def bind(self, ratio):
        """Called by the model that holds the factors: `ratio(producer,
        consumer)` is F_producer / F_consumer, a float32 scalar tensor."""
        object.__setattr__(self, "_ratio", ratio)

    def call(self, inputs):
        if self._ratio is None:
            return tf.identity(inputs)
        return _rescaled_backward(inputs,
                                  self._ratio(self.producer, self.consumer))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "producer": self.producer,
                "consumer": self.consumer}

"""The gradient sets the step-level sections run on.

Full runs: a ResNet-50-like set (161 tensors, 25.5M values: the shape of a
real network, many small tensors and a few large ones), 1000 tensors of 1000
values (the cost per tensor), and 4 tensors of 8M values (the cost per
byte). Quick runs use two small stand-ins that take the same code paths:
the tail of a narrow ResNet-50-like set (tiny gradients, which the unscale
packs and the check stacks by shape; a small one, divided and checked
alone; a large one, which the check sums) and 4 tensors of 100 values (tiny,
of one shape).
"""

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale

SEED = 0
SCALE = 2.0 ** 15


def resnet50_shapes(width=1):
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
    """Set name -> list of shapes."""
    if quick:
        # A third set would take no path these two do not.
        return {"ResNet-50-like /16, last 8": resnet50_shapes(16)[-8:],
                "4 x 100": [(100,)] * 4}
    return {"ResNet-50-like": resnet50_shapes(),
            "1000 x 1000": [(1000,)] * 1000,
            "4 x 8M": [(8_000_000,)] * 4}


def values(shapes):
    return sum(int(np.prod(shape)) for shape in shapes)


def is_large(shapes):
    """Large gradients: over 10,000 values per tensor on average (the
    ResNet-50-like and 4 x 8M sets; in quick mode, the ResNet-50-like
    one)."""
    return values(shapes) / len(shapes) > 10_000


def scaled_gradients(shapes):
    """Constant scaled gradients: unit-size values times `SCALE`."""
    rng = np.random.default_rng(SEED)
    return [tf.constant(rng.standard_normal(shape).astype(np.float32) * SCALE)
            for shape in shapes]


def variables(shapes):
    return [tf.Variable(tf.zeros(shape)) for shape in shapes]


def sgd_wrappers():
    """tf_lossscale's wrapper and Keras 3's around SGD(1e-9), both at
    `SCALE` and never growing it: the pair the step-level sections compare
    on these sets."""
    ours = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(1e-9), loss_scale=tf_lossscale.DynamicLossScale(
            SCALE, increment_period=10 ** 9))
    keras_wrapper = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1e-9), initial_scale=SCALE,
        dynamic_growth_steps=10 ** 9)
    return ours, keras_wrapper

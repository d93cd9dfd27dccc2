"""float16's range, statistics of tensors against it, and which variables of
a Keras model belong to layers computing in float16.

The tensor functions take a tensor or a nested structure (`None` skipped,
`tf.IndexedSlices` counted by their values) and return small tensors: nothing
is read back to the host.
"""

import math

import tensorflow as tf

from tf_lossscale.ops import finiteness

# Below the smallest normal value fewer significant bits remain (subnormal);
# below half the smallest subnormal a value becomes 0.
FLOAT16_MAX = 65504.0
FLOAT16_MIN_NORMAL = 2.0 ** -14
FLOAT16_MIN_SUBNORMAL = 2.0 ** -24


def headroom_log2(largest):
    """log2(65504 / largest), a Python float: how many times `largest` could
    double before it overflows float16; -inf for +inf, None for 0 or NaN."""
    if not largest or math.isnan(largest):
        return None
    return -math.inf if math.isinf(largest) else (
        math.log2(FLOAT16_MAX) - math.log2(largest))


def _values(tensor):
    return tf.convert_to_tensor(finiteness.dense_values(tensor))


def _present(tensors):
    return [_values(t) for t in tf.nest.flatten(tensors) if t is not None]


def is_finite(tensors):
    """A bool scalar: no value is NaN or +-Inf (integer tensors, such as
    token ids, always are)."""
    flags = [tf.reduce_all(tf.math.is_finite(values))
             for values in _present(tensors) if values.dtype.is_floating]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def largest_magnitude(tensors):
    """The largest |value|, a float32 scalar: +inf if any value is NaN or
    +-Inf (an exact check: under XLA a maximum skips NaN), 0 for none."""
    tops = [tf.reduce_max(tf.abs(tf.cast(values, tf.float32)))
            for values in _present(tensors)]
    # reduce_max of an empty tensor is -inf.
    largest = tf.reduce_max(tf.stack(tops + [tf.constant(0.0)]))
    return tf.where(is_finite(tensors), largest, math.inf)


def scaled_gradient_stats(grads, scale):
    """A step's gradients against float16's range at loss scale `scale`
    (what `LossScaleMonitor(gradient_stats=True)` logs): `grads` are the
    step's unscaled gradients. Returns a float32 vector `[tiny, count,
    largest]`: `tiny` of the `count` values have a scaled magnitude
    `|scale * g|` below 2**-14 (zero or subnormal in float16, true zeros
    included); `largest` is the largest scaled magnitude (`largest_magnitude`).
    """
    present = _present(grads)
    scale = tf.cast(scale, tf.float32)
    tiny = [tf.math.count_nonzero(tf.abs(tf.cast(values, tf.float32))
                                  < FLOAT16_MIN_NORMAL / scale)
            for values in present]
    count = [tf.cast(tf.size(values), tf.float32) for values in present]
    return tf.stack([
        tf.cast(tf.add_n(tiny + [tf.constant(0, tf.int64)]), tf.float32),
        tf.add_n(count + [tf.constant(0.0)]),
        largest_magnitude(present) * scale])


def nonzero_count(float32_grad):
    """Values of `float32_grad` that are not 0, a float32 scalar."""
    return tf.reduce_sum(tf.cast(tf.not_equal(_values(float32_grad), 0.0),
                                 tf.float32))


def underflow_count(float16_grad, float32_grad):
    """Values lost to float16 underflow, a float32 scalar: where the scaled
    gradient of a float16 backward pass is zero or subnormal in float16 and
    the same step's float32 gradient (same shape) is not 0."""
    lost = tf.logical_and(
        tf.abs(tf.cast(_values(float16_grad), tf.float32))
        < FLOAT16_MIN_NORMAL,
        tf.not_equal(_values(float32_grad), 0.0))
    return tf.reduce_sum(tf.cast(lost, tf.float32))


def _innermost_layers(layer):
    inner = getattr(layer, "layers", None)
    if not inner:
        return [layer]
    return [leaf for sublayer in inner for leaf in _innermost_layers(sublayer)]


def owners(model):
    """`{id(variable): layer}` for every trainable variable of `model`: the
    innermost layer that holds it."""
    owner = {}
    for layer in _innermost_layers(model):
        for variable in layer.trainable_weights:
            owner.setdefault(id(variable), layer)
    return owner


def takes_gradient_as_value(variable):
    """Whether the optimizer writes `variable`'s gradient into it instead
    of applying it (Keras' float8 scales and amax histories): not a
    gradient to measure."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def float16_variables(model):
    """The trainable variables of `model` whose layer computes in float16,
    in `model.trainable_variables` order."""
    owner = owners(model)
    return [variable for variable in model.trainable_variables
            if id(variable) in owner
            and owner[id(variable)].compute_dtype == "float16"
            and not takes_gradient_as_value(variable)]

"""float16's range, statistics of tensors against it, and which layers of a
Keras model compute in float16.

The tensor functions read float16 tensors, or float32 ones holding float16
values, and return small tensors: nothing is read back to the host, no state
is kept. `tf.IndexedSlices` count by their values; `None` is skipped.
"""

import math

import tensorflow as tf

from tf_lossscale.ops import finiteness

# Below the smallest normal value fewer significant bits remain (subnormal);
# below half the smallest subnormal a value becomes 0.
FLOAT16_MAX = 65504.0
FLOAT16_MIN_NORMAL = 2.0 ** -14
FLOAT16_MIN_SUBNORMAL = 2.0 ** -24
# log2(FLOAT16_MAX): headroom is measured in powers of 2 below it.
FLOAT16_MAX_LOG2 = math.log2(FLOAT16_MAX)


def headroom_log2(largest):
    """log2(65504 / largest), a Python float: how many times `largest` (a
    Python number) could double before it overflows float16; -inf for +inf,
    None for 0, NaN or None (no value)."""
    if largest is None or largest == 0 or math.isnan(largest):
        return None
    if math.isinf(largest):
        return -math.inf
    return FLOAT16_MAX_LOG2 - math.log2(largest)


def _values(tensor):
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tensor.values
    return tf.convert_to_tensor(tensor)


def _present(tensors):
    return [_values(t) for t in tf.nest.flatten(tensors) if t is not None]


def largest_magnitude(tensors):
    """The largest |value| in `tensors` (a tensor or a nested structure), as
    a float32 scalar: +inf if any value is NaN or +-Inf, 0 if there are no
    values."""
    largest = tf.constant(0.0, tf.float32)
    for values in _present(tensors):
        magnitude = tf.abs(tf.cast(values, tf.float32))
        finite = tf.reduce_all(tf.math.is_finite(magnitude))
        # reduce_max of an empty tensor is -inf; NaN compares false.
        top = tf.maximum(tf.reduce_max(magnitude), 0.0)
        largest = tf.maximum(largest, tf.where(finite, top, float("inf")))
    return largest


def is_finite(tensors):
    """A bool scalar: no value of `tensors` is NaN or +-Inf (integer
    tensors, such as token ids, always are)."""
    flags = [tf.reduce_all(tf.math.is_finite(values))
             for values in _present(tensors) if values.dtype.is_floating]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def element_count(tensors):
    """The number of values in `tensors`, a float32 scalar."""
    return tf.add_n([tf.cast(tf.size(values), tf.float32)
                     for values in _present(tensors)] + [tf.constant(0.0)])


def scaled_gradient_stats(grads, scale):
    """One step's gradients against float16's range, at loss scale `scale`
    (what `LossScaleMonitor(gradient_stats=True)` logs).

    Args:
      grads: the step's *unscaled* gradients (a tensor or a nested
        structure), as the float16 backward pass delivered them at `scale`
        and divided by it.
      scale: the loss scale the step ran with, a scalar.

    Returns:
      A float32 vector `[tiny, count, largest]`: `tiny` values whose scaled
      magnitude `|scale * g|` is below 2**-14 (zero or subnormal in float16,
      genuine zeros included), out of `count` values; `largest`, the largest
      scaled magnitude, +inf if any value is NaN or +-Inf (the exact check:
      under XLA a maximum skips NaN).
    """
    present = _present(grads)
    scale = tf.cast(scale, tf.float32)
    threshold = tf.constant(FLOAT16_MIN_NORMAL, tf.float32) / scale
    tiny = [tf.constant(0, tf.int64)]
    tops = [tf.constant(0.0)]
    for values in present:
        magnitude = tf.abs(tf.cast(values, tf.float32))
        tops.append(tf.reduce_max(magnitude))
        tiny.append(tf.cast(tf.reduce_sum(
            tf.cast(magnitude < threshold, tf.int32)), tf.int64))
    largest = tf.maximum(tf.reduce_max(tf.stack(tops)), 0.0) * scale
    largest = tf.where(finiteness.all_finite(present), largest,
                       float("inf"))
    return tf.stack([tf.cast(tf.add_n(tiny), tf.float32),
                     element_count(present), largest])


def nonzero_count(float32_grad):
    """Values of `float32_grad` that are not 0, a float32 scalar."""
    values = _values(float32_grad)
    return tf.reduce_sum(tf.cast(tf.not_equal(values, 0.0), tf.float32))


def underflow_count(float16_grad, float32_grad):
    """Values lost to float16 underflow, a float32 scalar: the positions
    where `float16_grad` (a float16 backward pass's gradient, scaled,
    possibly cast to float32) is zero or subnormal in float16 while
    `float32_grad` (the same step's gradient computed in float32, of the
    same shape) is not 0."""
    lost = tf.logical_and(
        tf.abs(tf.cast(_values(float16_grad), tf.float32))
        < FLOAT16_MIN_NORMAL,
        tf.not_equal(_values(float32_grad), 0.0))
    return tf.reduce_sum(tf.cast(lost, tf.float32))


# Which layers of a Keras model compute in float16, and what they own.


def compute_dtype(layer):
    """The dtype `layer` computes in, e.g. "float16", as a string."""
    policy = getattr(layer, "dtype_policy", None)
    dtype = getattr(policy, "compute_dtype", None) or getattr(
        layer, "compute_dtype", None) or "float32"
    return getattr(dtype, "name", dtype)


def is_input_layer(layer):
    """Whether `layer` is a model's `InputLayer` (no computation)."""
    return type(layer).__name__ == "InputLayer"


def variable_name(variable):
    """A variable's path (Keras 3) or name (tf-keras), for reports."""
    return getattr(variable, "path", None) or variable.name


def _innermost_layers(layer):
    inner = getattr(layer, "layers", None)
    if not inner:
        yield layer
        return
    for sublayer in inner:
        yield from _innermost_layers(sublayer)


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
            and compute_dtype(owner[id(variable)]) == "float16"
            and not takes_gradient_as_value(variable)]

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


def _present(tensors):
    return [tf.convert_to_tensor(finiteness.dense_values(t))
            for t in tf.nest.flatten(tensors) if t is not None]


def is_finite(tensors):
    """A bool scalar: no value is NaN or +-Inf (integer tensors, such as
    token ids, always are)."""
    flags = [finiteness.is_finite(values)
             for values in _present(tensors) if values.dtype.is_floating]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def largest_magnitude(tensors, xla=False):
    """The largest |value|, a float32 scalar: +inf if any value is NaN or
    +-Inf (exact; `xla`: traced for XLA), 0 for none."""
    return _measure(_present(tensors), xla=xla)[1]


def scaled_gradient_stats(grads, scale, xla=False):
    """A step's unscaled `grads` against float16's range at loss scale
    `scale` (what `LossScaleMonitor(gradient_stats=True)` logs): a float32
    vector `[tiny, count, largest]`: `tiny` of the `count` values have a
    scaled magnitude below 2**-14 (zero or subnormal in float16), `largest`
    is the largest scaled magnitude. `xla`: traced for XLA."""
    present = _present(grads)
    scale = tf.cast(scale, tf.float32)
    tiny, largest = _measure(present, FLOAT16_MIN_NORMAL / scale, xla)
    sizes = [values.shape.num_elements() for values in present]
    count = tf.constant(float(sum(n for n in sizes if n is not None)))
    for values, size in zip(present, sizes):
        if size is None:
            count += tf.cast(tf.size(values), tf.float32)
    return tf.stack([tf.cast(tiny, tf.float32), count, largest * scale])


# Without XLA, small values (of a static size up to this) are measured
# concatenated: a handful of kernels per step however many small gradients a
# model has, for one copy of values that are cheap to copy.
_CONCATENATED_ELEMENTS = 1 << 16
# The most 0s and 1s a sum in that type counts exactly (float32: every
# partial sum is then an integer no larger than 2**24).
_EXACT_COUNTS = {"int32": 2**31 - 1, "float32": 2**24}


def _measure(present, threshold=None, xla=False):
    """`(tiny, largest)` of the values of `present`: how many have a
    magnitude below `threshold` (int64; 0 without one), and the largest
    magnitude (float32; +inf after NaN or +-Inf, 0 for none). `xla`: traced
    for XLA, whose maximum may skip NaN: each tensor's finiteness is then
    checked too (docs/guides/performance.md, "How it stays cheap and exact").
    """
    values = [tf.cast(v, tf.float32) for v in present]
    tiny, tops, finite = [tf.constant(0, tf.int64)], [tf.constant(0.0)], []
    for part in values if xla else _concatenated(values):
        magnitudes = tf.abs(part)
        tops.append(tf.reduce_max(magnitudes))
        if xla:
            finite.append(finiteness.is_finite(part))
        if threshold is not None:
            tiny.append(_count(magnitudes < threshold, xla))
    tops = tf.stack(tops)
    nonfinite = tf.reduce_any(tf.math.is_nan(tops))
    if finite:
        nonfinite = tf.logical_or(nonfinite, tf.logical_not(
            tf.reduce_all(tf.stack(finite))))
    return tf.add_n(tiny), tf.where(nonfinite, math.inf, tf.reduce_max(tops))


def _concatenated(values):
    """`values`, the small ones flattened into one tensor."""
    is_small = [v.shape.num_elements() is not None
                and v.shape.num_elements() <= _CONCATENATED_ELEMENTS
                for v in values]
    small = [tf.reshape(v, [-1]) for v, s in zip(values, is_small) if s]
    large = [v for v, s in zip(values, is_small) if not s]
    return ([tf.concat(small, axis=0)] if len(small) > 1 else small) + large


def _count(mask, xla):
    """The True values of `mask`, int64, summed in the cheapest exact type
    (int32 under XLA, float32 below 2**24 values without; else int64)."""
    size = mask.shape.num_elements()
    dtype = tf.int32 if xla else tf.float32
    if size is None or size > _EXACT_COUNTS[dtype.name]:
        dtype = tf.int64
    return tf.cast(tf.reduce_sum(tf.cast(mask, dtype)), tf.int64)


def flatten(grads, variables):
    """The gradients of `variables` (dense, float32, 0 for None) as one
    vector, each variable's values in turn: per-variable statistics are then
    a few ops on it (`*_by_variable`), not a few per variable."""
    return tf.concat([
        tf.zeros([variable.shape.num_elements()]) if grad is None else
        # Sparse gradients (embeddings) made dense, to compare position by
        # position; rows absent from the batch are 0.
        tf.reshape(tf.cast(tf.convert_to_tensor(grad), tf.float32), [-1])
        for grad, variable in zip(grads, variables)], axis=0)


def variable_ids(variables):
    """The index of the variable each value of `flatten(...)` belongs to."""
    sizes = tf.constant([v.shape.num_elements() for v in variables], tf.int32)
    # Not tf.repeat: it builds a variables x largest-variable mask first.
    return tf.ragged.row_splits_to_segment_ids(
        tf.concat([[0], tf.cumsum(sizes)], axis=0))


def _by_variable(reduce, values, ids, count):
    """`reduce` (a sorted segment reduction) of `values` per variable, 0
    for a variable with no values."""
    # Sorted segment ops: several times faster than the unsorted ones.
    reduced = reduce(values, ids)
    return tf.pad(reduced, [[0, count - tf.shape(reduced)[0]]])


def largest_by_variable(flat, ids, count):
    """Each variable's largest |value| (float32; +inf where one is NaN or
    +-Inf, 0 for none)."""
    magnitudes = tf.where(tf.math.is_finite(flat), tf.abs(flat), math.inf)
    return tf.maximum(
        _by_variable(tf.math.segment_max, magnitudes, ids, count), 0.0)


def nonfinite_by_variable(flat, ids, count):
    """1.0 for each variable with a NaN or +-Inf value, else 0.0."""
    return _by_variable(
        tf.math.segment_max,
        tf.cast(tf.logical_not(tf.math.is_finite(flat)), tf.float32), ids,
        count)


def nonzero_by_variable(float32_flat, ids, count):
    """Each variable's values that are not 0 (float32 counts)."""
    return _by_variable(
        tf.math.segment_sum,
        tf.cast(tf.not_equal(float32_flat, 0.0), tf.float32), ids, count)


def squares_by_variable(float32_flat, ids, count):
    """Each variable's squared norm, float64 (float32 squares of values
    below 1e-19 would underflow)."""
    return _by_variable(tf.math.segment_sum,
                        tf.square(tf.cast(float32_flat, tf.float64)), ids,
                        count)


def underflow_by_variable(float16_flat, float32_flat, scale, ids, count):
    """What float16 underflow loses of each variable's gradient:
    `(values, squares)`. `values` (float32 counts): where the scaled
    gradient of a float16 backward pass (`float16_flat`, at loss scale
    `scale`) is zero or subnormal in float16 and the same step's float32
    gradient is not 0. `squares` (float64): the squared norm, over those
    values, of the float32 gradient less the float16 one unscaled: all of it
    where float16 gave 0, the bits lost where it kept a subnormal."""
    lost = tf.logical_and(tf.abs(float16_flat) < FLOAT16_MIN_NORMAL,
                          tf.not_equal(float32_flat, 0.0))
    difference = tf.where(lost, float32_flat - float16_flat / scale, 0.0)
    return (
        _by_variable(tf.math.segment_sum, tf.cast(lost, tf.float32), ids,
                     count),
        _by_variable(tf.math.segment_sum,
                     tf.square(tf.cast(difference, tf.float64)), ids, count))


def _innermost_layers(layer):
    inner = getattr(layer, "layers", None)
    if not inner:
        return [layer]
    return [leaf for sublayer in inner for leaf in _innermost_layers(sublayer)]


def takes_gradient_as_value(variable):
    """Whether the optimizer writes `variable`'s gradient into it instead
    of applying it (Keras' float8 scales and amax histories): not a
    gradient to measure."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def float16_variables(model):
    """The trainable variables of `model` whose layer computes in float16,
    in `model.trainable_variables` order."""
    owner = {}  # id(variable) -> the innermost layer that holds it
    for layer in _innermost_layers(model):
        for variable in layer.trainable_weights:
            owner.setdefault(id(variable), layer)
    return [variable for variable in model.trainable_variables
            if id(variable) in owner
            and owner[id(variable)].compute_dtype == "float16"
            and not takes_gradient_as_value(variable)]

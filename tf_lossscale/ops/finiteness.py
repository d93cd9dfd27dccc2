"""The per-step finiteness check on gradients: the hot path of loss scaling.

Exact, and on the gradients' devices. Gradients: a tensor or any nested
structure of dense tensors, `tf.IndexedSlices` (values checked) and `None`
(ignored), in float16, bfloat16, float32 or float64; none at all count as
finite. How it stays cheap (stacking, the sum sentinel, checks through the
unscale's split): docs/guides/performance.md, "How it stays cheap and exact".
"""
import collections

import tensorflow as tf

# Stacking cuts the check's ops by a third or more where models have many
# small gradients; above this size, the sum is faster than `is_finite`.
_STACKED_ELEMENTS = 1 << 16


def flatten_gradients(grads):
    """The gradients in `grads` as a flat list of tensors and
    `tf.IndexedSlices`, `None`s removed (their dtypes are the caller's to
    check: `_internal/checks.gradients`)."""
    return [grad if isinstance(grad, tf.IndexedSlices)
            else tf.convert_to_tensor(grad)
            for grad in tf.nest.flatten(grads) if grad is not None]


def dense_values(grad):
    """The tensor whose elements are the gradient's values."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def is_finite(values):
    """Exact: a scalar bool tensor, True iff no element is NaN or +-Inf."""
    return tf.reduce_all(tf.math.is_finite(values))


def _conjunction(flags):
    if not flags:
        return tf.constant(True)
    return flags[0] if len(flags) == 1 else tf.reduce_all(tf.stack(flags))


def _is_small(values):
    count = values.shape.num_elements()
    return count is not None and count <= _STACKED_ELEMENTS


def _stacks(values):
    """[(indices into `values`, tensor)]: small tensors of one dtype and
    static shape stacked along a new first axis, every other one alone."""
    groups = collections.defaultdict(list)
    for index, value in enumerate(values):
        # as_list: under TF1's V1 shapes, a shape's items are unhashable.
        key = ((value.dtype, tuple(value.shape.as_list()))
               if _is_small(value) else index)
        groups[key].append(index)
    return [(group, values[group[0]] if len(group) == 1
             else tf.stack([values[i] for i in group]))
            for group in groups.values()]


def _through_splits(values):
    """`values`, each complete set of one split's outputs (graphs) replaced
    by the split's input: the same elements, without stacking them again."""
    splits, rest = {}, []  # split op -> {output index: [values]}; ordered
    for value in values:
        source = value
        while (tf.is_symbolic_tensor(source)
               and source.op.type in ("Reshape", "Identity")):
            source = source.op.inputs[0]
        if (tf.is_symbolic_tensor(source)
                and source.op.type in ("SplitV", "Unpack")):
            splits.setdefault(source.op, {}).setdefault(
                source.value_index, []).append(value)
        else:
            rest.append(value)
    for op, outputs in splits.items():
        rest += ([op.inputs[0]] if len(outputs) == len(op.outputs)
                 else [v for same in outputs.values() for v in same])
    return rest


def _sum_check(large):
    # A float64 sum beyond float32 becomes inf here: a "maybe", as is any
    # overflow, which the exact branch settles.
    total = tf.add_n([tf.cast(tf.reduce_sum(v), tf.float32) for v in large])
    return tf.cond(tf.math.is_finite(total), lambda: tf.constant(True),
                   lambda: _conjunction([is_finite(v) for v in large]))


def all_finite(grads):
    """Returns a scalar bool tensor: True iff no gradient holds NaN or +-Inf
    (floating-point gradients: the caller checks them)."""
    values = _through_splits(
        [dense_values(grad) for grad in flatten_gradients(grads)])
    flags = [is_finite(stacked) for _, stacked
             in _stacks([v for v in values if _is_small(v)])]
    large = [v for v in values if not _is_small(v)]
    if large:
        flags.append(_sum_check(large))
    return _conjunction(flags)


def nonfinite_flags(grads):
    """Exact per-gradient flags: a bool vector with one element for each
    entry of `tf.nest.flatten(grads)`, True where that gradient holds NaN or
    +-Inf (`None` entries: False)."""
    entries = tf.nest.flatten(grads)
    present = [i for i, grad in enumerate(entries) if grad is not None]
    finite = [tf.constant(True)] * len(entries)
    for group, values in _stacks([dense_values(entries[i]) for i in present]):
        flags = [is_finite(values)] if len(group) == 1 else tf.unstack(
            tf.reduce_all(tf.math.is_finite(values),
                          axis=list(range(1, values.shape.rank))))
        for index, flag in zip(group, flags):
            finite[present[index]] = flag
    if not finite:
        return tf.zeros([0], tf.bool)
    return tf.logical_not(tf.stack(finite))


def largest_magnitudes(values, xla=False):
    """`(largest, order)`: `largest` a float32 vector, each tensor's largest
    |value| (0 for an empty one), +inf where it holds NaN or +-Inf: finite
    exactly where the tensor is (a float64 tensor beyond float32's range
    counts as +inf). `largest[i]` is that of `values[order[i]]`: small
    tensors of one shape are measured stacked. `xla`: whether XLA compiles
    the ops (checked while tracing), whose maximum may drop NaN."""
    axes = {}

    def extremes(value, first):
        """Without XLA, the largest and the smallest value (two reads, and
        no |value| written out; TensorFlow's Max and Min kernels propagate
        NaN: Eigen::PropagateNaN); under XLA, the largest magnitude, NaN
        made +inf (one fused reduction)."""
        # One constant of reduction axes for each rank, not one a reduction.
        rank = value.shape.rank
        if (first, rank) not in axes:
            axes[first, rank] = tf.constant(list(range(first, rank)), tf.int32)
        axis = axes[first, rank]
        if xla:
            magnitudes = tf.abs(value)
            infinity = tf.constant(float("inf"), value.dtype)
            found = [tf.reduce_max(tf.where(
                tf.math.is_nan(magnitudes), infinity, magnitudes), axis=axis)]
        else:
            found = [tf.reduce_max(value, axis=axis),
                     tf.reduce_min(value, axis=axis)]
        if value.shape.num_elements() is None:  # Empty: the lowest float.
            found = [tf.where(tf.size(value) > 0, x, tf.zeros_like(x))
                     for x in found]
        return [tf.cast(x, tf.float32) for x in found]

    empty = [i for i, v in enumerate(values) if v.shape.num_elements() == 0]
    rest = [i for i in range(len(values)) if i not in empty]
    scalars = [[tf.constant(0.0)] * (1 if xla else 2)] * len(empty)
    order, vectors, stacked_order = list(empty), [], []
    for group, value in _stacks([values[i] for i in rest]):
        if len(group) == 1:
            scalars.append(extremes(value, 0))
            order.append(rest[group[0]])
        else:
            vectors.append(extremes(value, 1))
            stacked_order += [rest[i] for i in group]
    if scalars:
        vectors.insert(0, [tf.stack(list(x)) for x in zip(*scalars)])
    if not vectors:
        return tf.zeros([0]), []
    found = vectors[0] if len(vectors) == 1 else [
        tf.concat(list(x), axis=0) for x in zip(*vectors)]
    top = found[0] if xla else tf.maximum(found[0], -found[1])
    return (tf.where(tf.math.is_nan(top), float("inf"), top),
            order + stacked_order)

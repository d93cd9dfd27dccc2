"""The per-step finiteness check on gradients: the hot path of loss scaling.

`all_finite(grads)` answers one question per training step: is every element
of every gradient finite? The answer is exact, a scalar bool tensor computed
on the gradients' own devices and never read back to the host, so graph code
can branch on it.

How it stays cheap (each gradient is read once, nothing gradient-sized is
written):

* Gradients that are, together, every output of one split or unstack (as
  `tf_lossscale.ops.unscaling` makes them) are checked through that op's input:
  the same values, already in one tensor. Graphs only: eager tensors do not
  record the op that made them.
* Small gradients of the same dtype and static shape are stacked and checked
  with `is_finite` and `reduce_all` as one tensor: a handful of ops instead
  of two per gradient, on data that fits in cache.
* A large gradient is reduced to its sum: one op, which reads it once and
  writes nothing gradient-sized. NaN or +-Inf anywhere makes the sum
  non-finite (IEEE arithmetic propagates them); finite values make it
  non-finite only when the sum overflows its dtype (float16: beyond 65504;
  float32: only for values far beyond what a step with a useful loss scale
  produces).
* So a non-finite sum only says "maybe". Then, and only then, a `tf.cond`
  re-checks the large gradients exactly (`is_finite` and `reduce_all`), so a
  finite gradient set is never reported as non-finite, however large its
  values. The cond takes only the large gradients, which keeps it small: its
  cost grows with the number of its inputs.

`nonfinite_flags(grads)` gives one exact flag per gradient, for reporting
which ones overflowed; it runs on skipped steps only. It is built from as few
ops as it can be (one handful per pack, two per other gradient): in a graph,
even a branch that does not run costs a little for every op it holds.

Accepted gradients: a tensor, or any nested structure (lists, tuples, dicts) of
dense tensors, `tf.IndexedSlices` (only the values are checked) and `None`
(ignored), in float16, bfloat16, float32 or float64. No gradients at all count
as finite.
"""

import collections

import tensorflow as tf

# Gradients up to this many elements are checked exactly, stacked by shape.
_SMALL_ELEMENTS = 1 << 16


def flatten_gradients(grads):
    """Returns the gradients in `grads` as a flat list, `None`s removed.

    Raises:
      TypeError: a gradient is not a floating-point tensor.
    """
    flat = []
    for index, grad in enumerate(tf.nest.flatten(grads)):
        if grad is None:
            continue
        if not isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        if not grad.dtype.is_floating:
            raise TypeError(
                f"grads must be floating-point tensors, but gradient {index} "
                f"of the flattened grads has dtype {grad.dtype.name}")
        flat.append(grad)
    return flat


def dense_values(grad):
    """The tensor whose elements are the gradient's values."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def is_finite(values):
    """Exact: a scalar bool tensor, True iff no element is NaN or +-Inf."""
    return tf.reduce_all(tf.math.is_finite(values))


def _conjunction(flags):
    if not flags:
        return tf.constant(True)
    if len(flags) == 1:
        return flags[0]
    return tf.reduce_all(tf.stack(flags))


def _sentinel(values):
    """A float32 scalar that is never finite when `values` holds NaN or
    +-Inf, and is finite for finite `values` unless their sum overflows."""
    # A float64 sum beyond float32 becomes inf here: a "maybe", which the
    # exact fallback settles.
    return tf.cast(tf.reduce_sum(values), tf.float32)


def _split_source(values):
    """(split or unstack op, output index) that `values` is, up to reshapes
    and identities; None for anything else, and for eager tensors."""
    if not tf.is_symbolic_tensor(values):
        return None
    while values.op.type in ("Reshape", "Identity"):
        values = values.op.inputs[0]
    if values.op.type not in ("SplitV", "Unpack"):
        return None
    return values.op, values.value_index


def _merge_split_outputs(values):
    """`values` with every complete set of one split's outputs replaced by
    the split's input, which holds exactly their elements."""
    sources = [_split_source(value) for value in values]
    seen = {}  # split op -> output indices present; ordered, for stable graphs
    for source in sources:
        if source is not None:
            seen.setdefault(source[0], set()).add(source[1])
    complete = [op for op, indices in seen.items()
                if len(indices) == len(op.outputs)]
    if not complete:
        return values
    kept = [value for value, source in zip(values, sources)
            if source is None or source[0] not in complete]
    return kept + [op.inputs[0] for op in complete]


def _is_small(values):
    count = values.shape.num_elements()
    return count is not None and count <= _SMALL_ELEMENTS


def _small_flags(small):
    groups = collections.defaultdict(list)
    for values in small:
        # as_list: under TF1's V1 shapes, a shape's items are unhashable
        # Dimensions. A small gradient's shape is fully known.
        groups[(values.dtype, tuple(values.shape.as_list()))].append(values)
    return [is_finite(group[0] if len(group) == 1 else tf.stack(group))
            for group in groups.values()]


def _large_flag(large):
    if not large:
        return None
    quick = tf.math.is_finite(tf.add_n([_sentinel(v) for v in large]))
    return tf.cond(quick, lambda: tf.constant(True),
                   lambda: _conjunction([is_finite(v) for v in large]))


def all_finite(grads):
    """Returns a scalar bool tensor: True iff no gradient holds NaN or +-Inf.

    Exact for every input: see the module docstring for how it stays cheap.

    Raises:
      TypeError: a gradient is not a floating-point tensor.
    """
    values = _merge_split_outputs(
        [dense_values(grad) for grad in flatten_gradients(grads)])
    flags = _small_flags([v for v in values if _is_small(v)])
    large = _large_flag([v for v in values if not _is_small(v)])
    if large is not None:
        flags.append(large)
    return _conjunction(flags)


def nonfinite_flags(grads):
    """Exact per-gradient flags: a bool vector with one element for each
    entry of `tf.nest.flatten(grads)`, True where that gradient holds NaN or
    +-Inf (`None` entries: False).

    In graphs, gradients that are together every output of one unstack, or
    of one split of a vector (as `tf_lossscale.ops.unscaling` packs them), get
    their flags from that op's input with a handful of ops; every other
    gradient takes two.
    """
    values = [None if grad is None else dense_values(grad)
              for grad in tf.nest.flatten(grads)]
    outputs = {}  # split op -> {output index: [positions]}; ordered
    singles = []  # (position, values)
    for position, value in enumerate(values):
        source = None if value is None else _split_source(value)
        if source is None:
            if value is not None:
                singles.append((position, value))
            continue
        op, index = source
        outputs.setdefault(op, {}).setdefault(index, []).append(position)
    parts, order = [], {}  # flag vectors; position -> index in their concat
    offset = 0
    for op, by_index in outputs.items():
        flags = None
        if len(by_index) == len(op.outputs):
            flags = _split_nonfinite_flags(op)
        if flags is None:  # Not the whole split, or not one it can read.
            singles += [(position, op.outputs[index])
                        for index, positions in by_index.items()
                        for position in positions]
            continue
        parts.append(flags)
        for index, positions in by_index.items():
            order.update((position, offset + index) for position in positions)
        offset += len(op.outputs)
    if singles:
        parts.append(tf.logical_not(tf.stack(
            [is_finite(value) for _, value in singles])))
        order.update((position, offset + i)
                     for i, (position, _) in enumerate(singles))
        offset += len(singles)
    if len(order) < len(values):
        parts.append(tf.constant([False]))  # For the `None` entries.
    if not parts:
        return tf.zeros([0], tf.bool)
    flags = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
    indices = [order.get(position, offset) for position in range(len(values))]
    if indices == list(range(len(values))):
        return flags
    return tf.gather(flags, indices)


def _split_nonfinite_flags(op):
    """Per-output flags of an unstack, or of a split of a vector with known
    sizes, computed from its input; None for any other split."""
    values = op.inputs[0]
    rank = values.shape.rank
    if op.type == "Unpack" and rank is not None:
        axis = op.get_attr("axis") % rank
        return tf.logical_not(tf.reduce_all(
            tf.math.is_finite(values),
            axis=[d for d in range(rank) if d != axis]))
    sizes = tf.get_static_value(op.inputs[1]) if op.type == "SplitV" else None
    if rank != 1 or sizes is None or any(size < 0 for size in sizes):
        return None
    # Non-finite elements up to each split point, by a running count.
    bad = tf.cast(tf.logical_not(tf.math.is_finite(values)), tf.int64)
    counts = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(bad)], axis=0)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + int(size))
    return tf.gather(counts, bounds[1:]) > tf.gather(counts, bounds[:-1])

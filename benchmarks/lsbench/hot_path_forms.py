"""The finiteness check and the unscale, plain and with each technique alone.

The `hotpath` section times these side by side with the package's own. The
plain forms are what jmp and Keras 3 do: `reduce_all(is_finite(g))` per
gradient, then one `all`; one divide per gradient. Each technique is added to
the plain form alone:

* `stack`: small gradients (up to 65,536 values) of one dtype and shape are
  stacked and checked as one tensor.
* `sentinel`: larger gradients are reduced to a float32 sum, never finite
  when a value is NaN or +-Inf; only a non-finite sum re-checks them
  exactly (a `tf.cond`), so a sum that overflows is never a false alarm.
* `through_split`: gradients that are every output of one split or unstack
  (the packed unscale's) are checked through that op's input (graphs only);
  `split_flags` reads per-gradient flags that way.
* `packed`: tiny dense gradients (up to 4,096 values) of one dtype are
  concatenated, divided once and split back.

Every form gives exactly the plain form's results (the section compares
them bit for bit): the check is exact, the unscale one correctly rounded
divide per value either way.
"""

import collections

import numpy as np
import tensorflow as tf

import tf_lossscale
from tf_lossscale.ops import finiteness
from tf_lossscale.ops import float16
from tf_lossscale.step import loss_scaled_step

SMALL = 1 << 16  # Stacked, or else summed by the sentinel.
TINY = 1 << 12  # Packed by the packed unscale.


def _count(values):
    return values.shape.num_elements()


def _is_small(values):
    return _count(values) is not None and _count(values) <= SMALL


def _is_finite(values):
    return tf.reduce_all(tf.math.is_finite(values))


def _all(flags):
    if not flags:
        return tf.constant(True)
    return flags[0] if len(flags) == 1 else tf.reduce_all(tf.stack(flags))


def _stacked_flags(small):
    groups = collections.defaultdict(list)
    for values in small:
        groups[(values.dtype, tuple(values.shape.as_list()))].append(values)
    return [_is_finite(g[0] if len(g) == 1 else tf.stack(g))
            for g in groups.values()]


def _sentinel_flag(large):
    sums = [tf.cast(tf.reduce_sum(v), tf.float32) for v in large]
    return tf.cond(tf.math.is_finite(tf.add_n(sums)),
                   lambda: tf.constant(True),
                   lambda: _all([_is_finite(v) for v in large]))


def _split_of(values):
    """(op, output index) when `values` is an output of a split or unstack
    (through reshapes) in a graph; else None."""
    if values is None or not tf.is_symbolic_tensor(values):
        return None
    while values.op.type in ("Reshape", "Identity"):
        values = values.op.inputs[0]
    if values.op.type not in ("SplitV", "Unpack"):
        return None
    return values.op, values.value_index


def _by_split(values):
    """({split op: {output index: [positions]}}, positions of the others)."""
    splits, others = {}, []
    for position, value in enumerate(values):
        split = _split_of(value)
        if split is None:
            others.append(position)
        else:
            splits.setdefault(split[0], {}).setdefault(
                split[1], []).append(position)
    return splits, others


def check(grads, stack=False, sentinel=False, through_split=False):
    """A scalar bool, True iff every gradient is finite: the plain form,
    with the techniques named."""
    values = [finiteness.dense_values(g)
              for g in finiteness.flatten_gradients(grads)]
    if through_split:
        splits, others = _by_split(values)
        kept = [values[i] for i in others]
        for op, outputs in splits.items():
            kept += ([op.inputs[0]] if len(outputs) == len(op.outputs)
                     else [values[i] for same in outputs.values()
                           for i in same])
        values = kept
    small = [v for v in values if _is_small(v)]
    large = [v for v in values if not _is_small(v)]
    flags = (_stacked_flags(small) if stack
             else [_is_finite(v) for v in small])
    if sentinel and large:
        flags.append(_sentinel_flag(large))
    else:
        flags += [_is_finite(v) for v in large]
    return _all(flags)


def plain_check(grads):
    return check(grads)


def _divide(values, scale):
    wide = tf.float64 if values.dtype == tf.float64 else tf.float32
    return tf.cast(tf.cast(values, wide) / tf.cast(scale, wide), values.dtype)


def _divide_packed(grads, scale):
    flat = [g if g.shape.rank == 1 else tf.reshape(g, [-1]) for g in grads]
    parts = tf.split(_divide(tf.concat(flat, axis=0), scale),
                     [_count(g) for g in grads])
    return [p if g.shape.rank == 1 else tf.reshape(p, g.shape)
            for p, g in zip(parts, grads)]


def unscale(grads, scale, packed=False):
    """Every gradient of the list `grads` divided by `scale`."""
    grads = [g if g is None or isinstance(g, tf.IndexedSlices)
             else tf.convert_to_tensor(g) for g in grads]
    packs = collections.defaultdict(list)
    for i, g in enumerate(grads):
        if packed and isinstance(g, tf.Tensor) and 0 < (_count(g) or -1) <= TINY:
            packs[g.dtype].append(i)
    packs = [indices for indices in packs.values() if len(indices) > 1]
    out = list(grads)
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            out[i] = tf.IndexedSlices(_divide(g.values, scale), g.indices,
                                      g.dense_shape)
        elif g is not None and not any(i in p for p in packs):
            out[i] = _divide(g, scale)
    for indices in packs:
        quotients = _divide_packed([grads[i] for i in indices], scale)
        for i, quotient in zip(indices, quotients):
            out[i] = quotient
    return out


def plain_unscale(grads, scale):
    return unscale(grads, scale)


def plain_flags(grads):
    """Per-gradient flags, True where not finite (`None`: False)."""
    finite = [tf.constant(True) if g is None
              else _is_finite(finiteness.dense_values(g))
              for g in tf.nest.flatten(grads)]
    return tf.logical_not(tf.stack(finite)) if finite else tf.zeros([0], bool)


def _split_flags_of(op):
    """Per-output finiteness of an unstack, or of a split of a vector with
    known sizes, from its input; None for any other split."""
    values = op.inputs[0]
    rank = values.shape.rank
    if op.type == "Unpack" and rank is not None:
        axis = op.get_attr("axis") % rank
        return tf.unstack(tf.reduce_all(tf.math.is_finite(values), axis=[
            d for d in range(rank) if d != axis]))
    sizes = tf.get_static_value(op.inputs[1]) if op.type == "SplitV" else None
    if rank != 1 or sizes is None or any(size < 0 for size in sizes):
        return None
    # Non-finite values up to each split point, by a running count.
    bad = tf.cast(tf.logical_not(tf.math.is_finite(values)), tf.int64)
    counts = tf.concat([tf.zeros([1], tf.int64), tf.cumsum(bad)], axis=0)
    bounds = np.cumsum([0] + [int(size) for size in sizes])
    return tf.unstack(tf.equal(tf.gather(counts, bounds[1:]),
                               tf.gather(counts, bounds[:-1])))


def split_flags(grads):
    """`plain_flags`, reading every output of one split or unstack (the
    packed unscale's) through that op's input, in graphs."""
    entries = [None if g is None else finiteness.dense_values(g)
               for g in tf.nest.flatten(grads)]
    finite = [tf.constant(True) if v is None else None for v in entries]
    splits, _ = _by_split(entries)
    for op, outputs in splits.items():
        flags = (_split_flags_of(op) if len(outputs) == len(op.outputs)
                 else None)
        for index, positions in outputs.items():
            for position in positions:
                finite[position] = None if flags is None else flags[index]
    finite = [_is_finite(v) if f is None else f
              for v, f in zip(entries, finite)]
    return tf.logical_not(tf.stack(finite)) if finite else tf.zeros([0], bool)


class PlainParts(tf_lossscale.LossScaleOptimizer):
    """The Keras 3 wrapper with the step's check and unscale in plain
    form."""
    _step_parts = loss_scaled_step.FULL_STEP._replace(
        check=plain_check,
        unscale=lambda grads, variables, scale: [
            g if float16.takes_gradient_as_value(v) else q
            for g, v, q in zip(grads, variables, plain_unscale(grads, scale))])

"""Unscaling gradients: every value divided by the loss scale.

`unscale(grads, scale)` returns `grad / scale` for each gradient, with the
dtype, shape and kind (dense or `tf.IndexedSlices`) of the gradient and `None`
kept. The quotient is computed in float32 (float64 for float64 gradients) and
cast back: float16 cannot even hold scales above 65504, and float64 keeps its
precision.

Every element is one correctly rounded division, so the result is bit for
bit what a per-gradient divide gives, whichever way it is computed:

* Tiny dense gradients (up to `_PACK_ELEMENTS` values, static shape) of one
  dtype are packed: stacked (same shapes) or flattened and concatenated,
  divided once, and unstacked or split back. Models have many of them
  (biases, normalisation scales), and an op per gradient costs more than its
  arithmetic. In graphs, the pieces also let `finiteness.all_finite`
  check them through the packed quotient, without stacking them again.
* Every other gradient is divided on its own.
"""

import collections

import tensorflow as tf

# Gradients up to this many values are packed: biases and normalisation
# scales. Packing copies each value in and out, which for larger gradients
# costs more than the op of their own it saves.
_PACK_ELEMENTS = 1 << 12


def _wide_dtype(dtype):
    return tf.float64 if dtype == tf.float64 else tf.float32


def _divide(values, scale):
    wide = _wide_dtype(values.dtype)
    quotient = tf.cast(values, wide) / tf.cast(scale, wide)
    return tf.cast(quotient, values.dtype)


def _is_packable(grad):
    if isinstance(grad, tf.IndexedSlices):
        return False
    count = grad.shape.num_elements()
    return count is not None and 0 < count <= _PACK_ELEMENTS


def _divide_packed(grads, scale):
    """The divide of each of `grads` (dense, one dtype), computed packed."""
    if all(grad.shape == grads[0].shape for grad in grads):
        return tf.unstack(_divide(tf.stack(grads), scale))
    flat = [grad if grad.shape.rank == 1 else tf.reshape(grad, [-1])
            for grad in grads]
    parts = tf.split(_divide(tf.concat(flat, axis=0), scale),
                     [grad.shape.num_elements() for grad in grads])
    return [part if grad.shape.rank == 1 else tf.reshape(part, grad.shape)
            for part, grad in zip(parts, grads)]


def _divide_one(grad, scale):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(grad.values, scale), grad.indices,
                                grad.dense_shape)
    return _divide(grad, scale)


def unscale(grads, scale, keep=None):
    """Returns the list `grads` with every gradient divided by `scale`.

    Args:
      grads: a list of gradients: tensors (or what converts to one),
        `tf.IndexedSlices` or None.
      scale: the scalar loss scale.
      keep: optional list of bools, one per gradient; True returns that
        gradient as given instead of unscaled.

    Raises:
      ValueError: `keep` does not have one entry per gradient.
    """
    grads = [grad if grad is None or isinstance(grad, tf.IndexedSlices)
             else tf.convert_to_tensor(grad) for grad in grads]
    if keep is None:
        keep = [False] * len(grads)
    elif len(keep) != len(grads):
        raise ValueError(
            f"keep must have one entry per gradient: got {len(keep)} for "
            f"{len(grads)} gradients")
    unscaled = list(grads)
    packs = collections.defaultdict(list)
    for index, (grad, kept) in enumerate(zip(grads, keep)):
        if grad is None or kept:
            continue
        if _is_packable(grad):
            packs[grad.dtype].append(index)
        else:
            unscaled[index] = _divide_one(grad, scale)
    for indices in packs.values():
        if len(indices) == 1:
            unscaled[indices[0]] = _divide(grads[indices[0]], scale)
            continue
        quotients = _divide_packed([grads[i] for i in indices], scale)
        for index, quotient in zip(indices, quotients):
            unscaled[index] = quotient
    return unscaled


def unscale_structure(grads, scale):
    """`unscale` for any nested structure of gradients, structure kept."""
    return tf.nest.pack_sequence_as(
        grads, unscale(tf.nest.flatten(grads), scale))

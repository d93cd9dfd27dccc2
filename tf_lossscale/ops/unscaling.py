"""Unscaling gradients: every value divided by the loss scale.

In float32 (float64 for float64 gradients; float16 cannot hold scales above
65504), cast back; tiny dense gradients are packed, bit for bit a
per-gradient divide's (docs/guides/performance.md).
"""
import collections

import tensorflow as tf

# Packing cuts the unscale's ops by a third or more where models have many
# tiny gradients (biases, normalisation scales); for larger ones its copies
# cost more than the ops it saves.
_PACKED_ELEMENTS = 1 << 12


def _divide(values, scale):
    wide = tf.float64 if values.dtype == tf.float64 else tf.float32
    return tf.cast(tf.cast(values, wide) / tf.cast(scale, wide), values.dtype)


def _divide_packed(grads, scale):
    """The quotients of `grads` (dense, one dtype), divided as one tensor."""
    if len(grads) == 1:
        return [_divide(grads[0], scale)]
    flat = [g if g.shape.rank == 1 else tf.reshape(g, [-1]) for g in grads]
    parts = tf.split(_divide(tf.concat(flat, axis=0), scale),
                     [g.shape.num_elements() for g in grads])
    return [part if g.shape.rank == 1 else tf.reshape(part, g.shape)
            for part, g in zip(parts, grads)]


def unscale(grads, scale, keep=None):
    """Returns the list `grads` (tensors, `tf.IndexedSlices` or None) with
    every gradient divided by the scalar `scale`, except where the optional
    list of bools `keep` is True: those come back as given.

    Raises:
      ValueError: `keep` does not have one entry per gradient.
    """
    grads = [grad if grad is None or isinstance(grad, tf.IndexedSlices)
             else tf.convert_to_tensor(grad) for grad in grads]
    keep = [False] * len(grads) if keep is None else keep
    if len(keep) != len(grads):
        raise ValueError(
            f"keep must have one entry per gradient: got {len(keep)} for "
            f"{len(grads)} gradients")
    unscaled = list(grads)
    packs = collections.defaultdict(list)  # dtype -> indices
    for index, (grad, kept) in enumerate(zip(grads, keep)):
        if grad is None or kept:
            continue
        if isinstance(grad, tf.IndexedSlices):
            unscaled[index] = tf.IndexedSlices(
                _divide(grad.values, scale), grad.indices, grad.dense_shape)
        elif 0 < (grad.shape.num_elements() or -1) <= _PACKED_ELEMENTS:
            packs[grad.dtype].append(index)
        else:
            unscaled[index] = _divide(grad, scale)
    for indices in packs.values():
        quotients = _divide_packed([grads[i] for i in indices], scale)
        for index, quotient in zip(indices, quotients):
            unscaled[index] = quotient
    return unscaled


def unscale_structure(grads, scale):
    """`unscale` for any nested structure of gradients, structure kept."""
    return tf.nest.pack_sequence_as(
        grads, unscale(tf.nest.flatten(grads), scale))

"""Unscaling gradients: every value divided by the loss scale.

`unscale(grads, scale)` returns `grad / scale` for each gradient, with the
dtype, shape and kind (dense or `tf.IndexedSlices`) of the gradient and `None`
kept. The quotient is computed in float32 (float64 for float64 gradients) and
cast back: float16 cannot even hold scales above 65504, and float64 keeps its
precision.

Every element is one correctly rounded division, so the result is bit for
bit what a per-gradient divide gives, whichever way it is computed:

* When the scale is a power of two whose reciprocal is a normal float32
  (2**-126 to 2**126: every scale `DynamicLossScale` reaches with its
  default rule, from 1 to 2**126), each value is multiplied by that
  reciprocal instead. The exact product and the exact quotient are the same
  number, which IEEE arithmetic rounds the same way (subnormal results and
  flushed-to-zero ones included), and a multiply costs the CPU a fraction
  of a division: for a training step's gradients, most of what unscaling
  costs. The choice is made on the scale's bits, per step (a `tf.cond`), so
  any other scale, restored or fixed, is divided as before.
* Tiny dense gradients (up to `_PACK_ELEMENTS` values, static shape) of one
  dtype are packed: stacked (same shapes) or flattened and concatenated,
  unscaled once, and unstacked or split back. Models have many of them
  (biases, normalisation scales), and an op per gradient costs more than its
  arithmetic. In graphs, the pieces also let `gradient_checks.all_finite`
  check them through the packed quotient, without stacking them again.
* Every other gradient is unscaled on its own.
"""

import collections

import tensorflow as tf

# Gradients up to this many values are packed: biases and normalisation
# scales. Packing copies each value in and out, which for larger gradients
# costs more than the op of their own it saves.
_PACK_ELEMENTS = 1 << 12
# The float32 exponent fields of the powers of two from 2**-126 to 2**126:
# their reciprocals are normal numbers too, which no CPU flushes to zero.
_EXACT_EXPONENTS = (1, 253)
_MANTISSA_BITS = 0x7FFFFF


def _wide_dtype(dtype):
    return tf.float64 if dtype == tf.float64 else tf.float32


def _divide(values, scale):
    wide = _wide_dtype(values.dtype)
    quotient = tf.cast(values, wide) / tf.cast(scale, wide)
    return tf.cast(quotient, values.dtype)


def _multiply(values, reciprocal):
    wide = _wide_dtype(values.dtype)
    product = tf.cast(values, wide) * tf.cast(reciprocal, wide)
    return tf.cast(product, values.dtype)


def _has_exact_reciprocal(scale):
    """A bool tensor: `scale` is a power of two from 2**-126 to 2**126, so
    that `x * (1 / scale)` is `x / scale` for every float32 (and float64)
    x; computed on the bits, as a CPU that flushes subnormals would misjudge
    the values."""
    bits = tf.bitcast(scale, tf.int32)
    exponent = tf.bitwise.right_shift(bits, 23)  # Negative scales: < 0.
    low, high = _EXACT_EXPONENTS
    return tf.logical_and(
        tf.equal(tf.bitwise.bitwise_and(bits, _MANTISSA_BITS), 0),
        tf.logical_and(exponent >= low, exponent <= high))


def _quotients(operands, scale):
    """Each of `operands` (dense tensors) divided by `scale`, bit for bit,
    through the reciprocal when that is exact."""
    scale = tf.convert_to_tensor(scale)
    if not operands:
        return []
    if scale.dtype != tf.float32:  # Not a loss scale's: divide.
        return [_divide(values, scale) for values in operands]
    reciprocal = 1.0 / scale
    quotients = tf.cond(
        _has_exact_reciprocal(scale),
        lambda: [_multiply(values, reciprocal) for values in operands],
        lambda: [_divide(values, scale) for values in operands])
    return tf.nest.flatten(quotients)  # A one-tensor list may come back bare.


def _is_packable(grad):
    if isinstance(grad, tf.IndexedSlices):
        return False
    count = grad.shape.num_elements()
    return count is not None and 0 < count <= _PACK_ELEMENTS


class _Pack:
    """Tiny dense gradients of one dtype as one tensor, and back."""

    def __init__(self, grads):
        self._shapes = [grad.shape for grad in grads]
        self._stacked = all(shape == self._shapes[0] for shape in self._shapes)
        if self._stacked:
            self.values = tf.stack(grads)
        else:
            self.values = tf.concat(
                [grad if grad.shape.rank == 1 else tf.reshape(grad, [-1])
                 for grad in grads], axis=0)

    def unpack(self, values):
        if self._stacked:
            return tf.unstack(values)
        parts = tf.split(values, [shape.num_elements()
                                  for shape in self._shapes])
        return [part if shape.rank == 1 else tf.reshape(part, shape)
                for part, shape in zip(parts, self._shapes)]


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
    by_dtype = collections.defaultdict(list)  # Packable, by dtype.
    singles = []
    for index, (grad, kept) in enumerate(zip(grads, keep)):
        if grad is None or kept:
            continue
        if _is_packable(grad):
            by_dtype[grad.dtype].append(index)
        else:
            singles.append(index)
    packs = []
    for indices in by_dtype.values():
        if len(indices) == 1:
            singles += indices
        else:
            packs.append((indices, _Pack([grads[i] for i in indices])))
    operands = ([pack.values for _, pack in packs]
                + [_dense(grads[index]) for index in singles])
    quotients = _quotients(operands, scale)
    unscaled = list(grads)
    for (indices, pack), values in zip(packs, quotients):
        for index, quotient in zip(indices, pack.unpack(values)):
            unscaled[index] = quotient
    for index, values in zip(singles, quotients[len(packs):]):
        grad = grads[index]
        unscaled[index] = (
            tf.IndexedSlices(values, grad.indices, grad.dense_shape)
            if isinstance(grad, tf.IndexedSlices) else values)
    return unscaled


def _dense(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def unscale_structure(grads, scale):
    """`unscale` for any nested structure of gradients, structure kept."""
    return tf.nest.pack_sequence_as(
        grads, unscale(tf.nest.flatten(grads), scale))

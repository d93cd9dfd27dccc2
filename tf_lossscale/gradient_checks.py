"""The per-step finiteness check on gradients: the hot path of loss scaling.

`all_finite(grads)` answers one question per training step: is every element
of every gradient finite? It reduces each gradient to a single boolean on the
gradient's own device and then those booleans to one, so no full-size tensor
is copied or moved, and it never reads a value back to the host: the answer is
a scalar bool tensor that graph code can branch on.

Accepted gradients: a tensor, or any nested structure (lists, tuples, dicts) of
dense tensors, `tf.IndexedSlices` (only the values are checked) and `None`
(ignored), in float16, bfloat16, float32 or float64. No gradients at all count
as finite.
"""

import tensorflow as tf


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


def _dense_values(grad):
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def all_finite(grads):
    """Returns a scalar bool tensor: True iff no gradient holds NaN or +-Inf."""
    flags = [
        tf.reduce_all(tf.math.is_finite(_dense_values(grad)))
        for grad in flatten_gradients(grads)
    ]
    if not flags:
        return tf.constant(True)
    if len(flags) == 1:
        return flags[0]
    return tf.reduce_all(tf.stack(flags))

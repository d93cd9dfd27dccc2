"""A loss scale reads as its current value, as a scalar float32 tensor does.

tf-keras' and TensorFlow's `LossScaleOptimizer.loss_scale` is a tensor; in
tf_lossscale it is the `LossScale` itself, and calling it gives that tensor
(`opt.loss_scale()`). So that code written for a tensor keeps working, every
`LossScale` also reads as the number it holds:

* `tf.convert_to_tensor(scale)`, and so any TensorFlow op or tensor
  arithmetic: `tf.cast(scale, tf.float16)`, `loss * scale`,
  `tf.summary.scalar("loss_scale", scale)`;
* `float(scale)`, `np.asarray(scale)` and `scale.numpy()`, eagerly;
* `tf.is_tensor(scale)` is True, with `dtype` float32 and a scalar `shape`,
  so `tf.keras.backend.get_value(scale)` (tf-keras and Keras 3) gives the
  number;
* in a TF1 graph, `session.run(scale)` fetches the current value.

Each reading is the value at that moment: read again after a step. Python
numbers do not combine with it directly (`2 * scale` raises TypeError; use
`2 * float(scale)` or a tensor).

Two of these hooks are TensorFlow protocols without a public name
(`tf.is_tensor` and `Session.run`): `tf_lossscale._internal.private_api.TensorLike`.
"""

import weakref

import numpy as np
import tensorflow as tf

from tf_lossscale._internal import private_api


class ReadsAsTensor(private_api.TensorLike):
    """Mixin for `LossScale`: reads as `self()`, a scalar float32 tensor."""

    dtype = tf.float32
    shape = tf.TensorShape([])

    def numpy(self):
        """The current scale as a numpy float32 scalar (eagerly)."""
        return self().numpy()

    def __float__(self):
        return float(self.numpy())

    def __array__(self, dtype=None, copy=None):
        del copy  # A new array every time.
        return np.asarray(self.numpy(), dtype=dtype)

    def _graph_read(self):
        """`Session.run(self)` in a TF1 graph: one read op per graph, made
        on first fetch and fetched again after that."""
        graph = tf.compat.v1.get_default_graph()
        reads = self.__dict__.setdefault("_graph_reads",
                                         weakref.WeakKeyDictionary())
        if graph not in reads:
            reads[graph] = self()
        return reads[graph]


def _to_tensor(value, dtype=None, name=None, as_ref=False):
    """`tf.convert_to_tensor` of a `ReadsAsTensor`: `value()`. A request for
    another dtype is refused, as for a float32 tensor (`tf.cast` converts)."""
    del as_ref
    if dtype is not None and not tf.as_dtype(dtype).is_compatible_with(
            tf.float32):
        raise ValueError(
            f"Tensor conversion requested dtype {tf.as_dtype(dtype).name} for "
            f"{value!r}, whose value is float32; use tf.cast(loss_scale, "
            f"{tf.as_dtype(dtype).name})")
    return tf.identity(value(), name=name) if name else value()


tf.register_tensor_conversion_function(ReadsAsTensor, _to_tensor)

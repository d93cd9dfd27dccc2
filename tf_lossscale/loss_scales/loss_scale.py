"""The `LossScale` contract, and `FixedLossScale`.

Loss scaling multiplies the loss by S before differentiating and divides the
gradients by S after, lifting float16 gradients that would underflow into
range. A loss scale supplies S and adjusts it from the unscaled gradients:

* calling it returns S as a scalar float32 tensor;
* `update(grads)` takes a nested structure of unscaled gradients (None
  ignored) and returns `(update_op, should_apply_gradients)`: eagerly
  `update_op` is None and the state has changed; in a graph it is an
  `Operation` that changes the state when run. When `should_apply_gradients`
  (a bool or a scalar bool tensor) is False, the step must be skipped;
* `get_config()` / `from_config()` round-trip the parameters; the state lives
  in variables and travels in checkpoints.

Under `tf.distribute`, `update` works in cross-replica context and inside
`strategy.run`, and every replica on every worker gets the same answer.
"""

import abc
import weakref

import numpy as np
import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale._internal import private_api
from tf_lossscale.loss_scales import failure_policy
from tf_lossscale.ops import finiteness
from tf_lossscale.ops import replicas


def graph_op(op):
    """`op` while building a graph; None when executing eagerly."""
    return None if tf.executing_eagerly() else op


# The loss scales in a `LossScaleGroup` (weakly), which only the group moves.
GROUPED = weakref.WeakKeyDictionary()
# The optimizer wrappers holding each loss scale (weakly, both ways).
_HOLDERS = weakref.WeakKeyDictionary()


def holders(loss_scale):
    """The living optimizer wrappers that hold `loss_scale`, oldest first."""
    return [owner for owner in (ref() for ref in _HOLDERS.get(loss_scale, ()))
            if owner is not None]


def add_holder(loss_scale, owner):
    """Records that the optimizer wrapper `owner` holds `loss_scale`."""
    _HOLDERS[loss_scale] = [weakref.ref(o)
                            for o in holders(loss_scale) + [owner]]


def update_from_grads(loss_scale, grads):
    """`update` of a built-in loss scale: its flag and update are computed
    in cross-replica context (through `merge_call` from a replica).

    In a TF1 graph `should_apply` is the bare flag, evaluable without the
    state variables, as with TensorFlow's reference; inside a `tf.function`
    it waits for the state check and the update, so a branch on it cannot
    apply a step that failed.
    """
    replicas.check_supported()
    if loss_scale in GROUPED:
        raise ValueError(
            f"{loss_scale!r} is the loss scale of a LossScaleGroup, which "
            "moves it once per iteration: update it through the group's "
            "members (the optimizers given the group, or group.join())")
    # pylint: disable=protected-access
    return replicas.call_in_cross_replica_context(
        lambda grads: loss_scale._update_from_all_finite(
            replicas.all_replicas_true(  # Checked as each replica's.
                lambda local: finiteness.all_finite(checks.gradients(local)),
                grads),
            gated=tf.compat.v1.executing_eagerly_outside_functions()), grads)


class LossScale(private_api.TensorLike, private_api.Trackable,
                metaclass=abc.ABCMeta):
    """Abstract base of loss scales; the module docstring states the contract.

    A loss scale also reads as its current value wherever a scalar float32
    tensor would: `float(scale)`, `np.asarray(scale)`, TensorFlow ops and
    `tf.convert_to_tensor`, `tf.keras.backend.get_value`, and
    `session.run(scale)` in a TF1 graph. Each reading is the value at that
    moment. Subclasses create their state with `_add_state_variable`.
    """

    dtype = tf.float32
    shape = tf.TensorShape([])

    def __init__(self):
        self._state_variables = {}

    @abc.abstractmethod
    def __call__(self):
        """Returns the current loss scale as a scalar float32 tensor."""

    @abc.abstractmethod
    def update(self, grads):
        """Updates the loss scale from one step's unscaled gradients.

        Args:
          grads: a nested structure of unscaled gradients (tensors,
            `tf.IndexedSlices` or `None`, which is ignored).

        Returns:
          `(update_op, should_apply_gradients)`, as the module docstring says.
        """

    @abc.abstractmethod
    def get_config(self):
        """Returns the constructor arguments as a JSON-able dict."""

    @classmethod
    def from_config(cls, config):
        """Creates a loss scale from the output of `get_config`."""
        return cls(**config)

    @property
    def variables(self):
        """The state variables, in creation order (empty if stateless)."""
        return tuple(self._state_variables.values())

    def check_loadable(self, values):
        """Raises, before anything is assigned, unless each of `values` (one
        per variable, None for one a file lacks) can be assigned exactly.

        Raises:
          TypeError, ValueError: naming the variable and the value.
        """
        # A subclass of users' may keep its variables its own way.
        names = {id(v): name for name, v in
                 getattr(self, "_state_variables", {}).items()}
        failure_policy.check_loadable(
            [((names.get(id(v), v.name), v), value)
             for v, value in zip(self.variables, values) if value is not None])

    def _add_state_variable(self, name, initial_value, dtype):
        variable = state_variable(name, initial_value, dtype)
        self._state_variables[name] = variable
        private_api.track(self, variable, name)
        return variable

    # Reading as a tensor.

    def numpy(self):
        """The current scale as a numpy float32 scalar (eagerly; syncs)."""
        return self().numpy()

    def __float__(self):
        return float(self.numpy())

    def __array__(self, dtype=None, copy=None):
        del copy  # A new array every time.
        return np.asarray(self.numpy(), dtype=dtype)

    def _graph_read(self):
        # One read op per graph: a TF1 loop fetching the scale every step
        # must not grow its graph.
        reads = self.__dict__.setdefault("_graph_reads",
                                         weakref.WeakKeyDictionary())
        graph = tf.compat.v1.get_default_graph()
        if graph not in reads:
            reads[graph] = self()
        return reads[graph]


def state_variable(name, initial_value, dtype):
    """A variable of loss-scaling state: not trainable, one value for every
    replica, made under the current strategy's scope (if any)."""
    return tf.Variable(
        initial_value, name=name, dtype=dtype, trainable=False,
        synchronization=tf.VariableSynchronization.AUTO,
        # Set once per step from a value all replicas agree on: summing
        # or averaging it across replicas would be wrong.
        aggregation=tf.VariableAggregation.NONE)


def _to_tensor(value, dtype=None, name=None, as_ref=False):
    """`tf.convert_to_tensor(loss_scale)`: its current value. Another dtype
    is refused as for a float32 tensor (`tf.cast` converts)."""
    del as_ref
    if dtype is not None and not tf.as_dtype(dtype).is_compatible_with(
            tf.float32):
        raise ValueError(
            f"Tensor conversion requested dtype {tf.as_dtype(dtype).name} for "
            f"{value!r}, whose value is float32; use tf.cast(loss_scale, "
            f"{tf.as_dtype(dtype).name})")
    return tf.identity(value(), name=name) if name else value()


tf.register_tensor_conversion_function(LossScale, _to_tensor)


class FixedLossScale(LossScale):
    """A loss scale that never changes.

    By default, as in TensorFlow, `update` never asks to skip a step and
    computes no finiteness check at all. With `skip_non_finite=True` a step
    whose gradients are not all finite (on any replica) is skipped, still
    without changing the scale: for `mixed_bfloat16`, whose range needs no
    scaling but whose weights a NaN batch would still ruin,
    `FixedLossScale(1, skip_non_finite=True)`.

    Args:
      loss_scale_value: a Python int or float >= 1 that fits in float32.
      skip_non_finite: keyword-only bool; True skips non-finite steps.

    Raises:
      TypeError: `loss_scale_value` is a bool or not a number, or
        `skip_non_finite` is not a bool.
      ValueError: `loss_scale_value` is < 1, NaN, inf or beyond float32.
    """

    def __init__(self, loss_scale_value, *, skip_non_finite=False):
        super().__init__()
        # A Python float, not a tensor, which could end up on another device
        # or in another graph than where it is used.
        self._loss_scale_value = checks.finite_float32(
            "loss_scale_value", loss_scale_value, at_least=1)
        self._skip_non_finite = checks.boolean(
            "skip_non_finite", skip_non_finite)

    @property
    def loss_scale_value(self):
        return self._loss_scale_value

    @property
    def skip_non_finite(self):
        return self._skip_non_finite

    # Whether `update` looks at the gradients at all.
    _needs_finiteness = skip_non_finite

    def __call__(self):
        return tf.constant(self._loss_scale_value, dtype=tf.float32)

    def update(self, grads):
        if not self._skip_non_finite:
            return graph_op(tf.no_op()), True
        return update_from_grads(self, grads)

    def _update_from_all_finite(self, all_finite, *, gated=True):
        """`update` given the all-replica finiteness flag (cross-replica);
        stateless, so `gated` changes nothing."""
        del gated
        should_apply = (tf.convert_to_tensor(all_finite)
                        if self._skip_non_finite else True)
        return graph_op(tf.no_op()), should_apply

    def get_config(self):
        skip = {"skip_non_finite": True} if self._skip_non_finite else {}
        return {"loss_scale_value": self._loss_scale_value, **skip}

    def __repr__(self):
        skip = ", skip_non_finite=True" if self._skip_non_finite else ""
        return f"FixedLossScale({self._loss_scale_value!r}{skip})"

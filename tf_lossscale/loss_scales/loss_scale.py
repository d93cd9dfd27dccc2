"""Loss scales: the contract every loss scale honours, and a fixed scale.

Loss scaling multiplies the loss by a factor S before differentiating and
divides the gradients by S afterwards::

    loss = compute_loss()
    scaled_grads = gradients(loss * S, variables)
    grads = scaled_grads / S

Mathematically nothing changes, but float16 intermediate gradients that would
underflow to zero are lifted into range. A `LossScale` supplies S and adjusts
it from the gradients it sees.

The contract every loss scale honours:

* calling it returns the current S as a scalar float32 `tf.Tensor`;
* `update(grads)` takes the *unscaled* gradients of one step (any nested
  structure; `None` entries are ignored) and returns
  `(update_op, should_apply_gradients)`. Eagerly, `update_op` is None and the
  state has already changed; while building a graph (`tf.function` or a TF1
  `tf.Graph`) it is an `Operation` that changes the state when run.
  `should_apply_gradients` is a Python bool or a scalar bool tensor; when it is
  False the caller must not apply this step's gradients;
* `get_config()` / `from_config(config)` round-trip the parameters (not the
  state: state lives in variables and travels in checkpoints).

Under `tf.distribute`, `update` may be called in cross-replica context with
per-replica gradients, or inside `strategy.run`; either way all replicas and
workers agree on the result (see `tf_lossscale.ops.replicas`). The built-in
loss scales split `update` in two: the all-replica finiteness flag, then
`_update_from_all_finite(all_finite)`, which runs once in cross-replica
context and holds the whole state transition, so an optimizer that computes
the flag itself can drive them directly.

What `should_apply_gradients` waits for in graphs:

* in a TF1 graph (a `tf.Graph` run by a `Session`, not a `tf.function` of
  an eager program), the built-in loss scales' `update` computes it from the
  gradients alone, as TensorFlow's reference does: evaluating it needs none
  of the loss scale's variables (not even their initializer) and neither
  checks nor changes the state. `update_op` carries the state check, the
  state change and the failure policy; run on a bad state it still fails and
  changes no variable. A caller that branches on the flag and must not apply
  a step that fails makes the branch wait for `update_op`
  (`tf.control_dependencies([update_op])`);
* inside a `tf.function` of an eager (TF2) program, where every stateful op
  runs anyway, and from `_update_from_all_finite` (what `LossScaleOptimizer`
  calls) in any graph, it is gated: it runs only after the state check, the
  assignments and the failure policy, so a branch on it cannot apply a step
  that failed.

The dynamic algorithm is stated in `tf_lossscale.loss_scales.dynamic_rule`, and
`DynamicLossScale` is in `tf_lossscale.loss_scales.dynamic_loss_scale`;
`from tf_lossscale.loss_scales.loss_scale import DynamicLossScale` still works (as do
`DynamicRule`, `DynamicState`, `next_dynamic_state`, `POLICIES` and
`WARNING_PREFIX`), but `tf_lossscale.DynamicLossScale` is the public name.
"""

import abc
import importlib

import tensorflow as tf

from tf_lossscale.ops import replicas
from tf_lossscale.loss_scales import failure_policy
from tf_lossscale._internal import private_api
from tf_lossscale.loss_scales import scale_reading
from tf_lossscale._internal import checks

# Moved in 0.4.0; still importable from here (`__getattr__`, imported on
# first use: those modules import this one).
_MOVED = {
    "DynamicLossScale": "tf_lossscale.loss_scales.dynamic_loss_scale",
    "DynamicRule": "tf_lossscale.loss_scales.dynamic_rule",
    "DynamicState": "tf_lossscale.loss_scales.dynamic_rule",
    "next_dynamic_state": "tf_lossscale.loss_scales.dynamic_rule",
    "POLICIES": "tf_lossscale.loss_scales.failure_policy",
    "WARNING_PREFIX": "tf_lossscale.loss_scales.failure_policy",
}


def __getattr__(name):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def graph_op(op):
    """`op` while building a graph; None when executing eagerly."""
    return None if tf.executing_eagerly() else op


def update_from_grads(loss_scale, grads):
    """Cross-replica context: the shared finiteness flag drives the update.

    In a TF1 graph, `should_apply` is not gated (module docstring): there the
    caller picks what a `Session` runs, and evaluating the flag must not need
    the state variables, as with TensorFlow's reference. Inside a
    `tf.function` every stateful op runs anyway, so gating costs nothing and
    keeps a branch on the flag from running on a step that fails.
    """
    # pylint: disable=protected-access
    return loss_scale._update_from_all_finite(
        replicas.all_replicas_finite(grads),
        gated=tf.compat.v1.executing_eagerly_outside_functions())


class LossScale(scale_reading.ReadsAsTensor, private_api.Trackable,
                metaclass=abc.ABCMeta):
    """Abstract base of loss scales; see the module docstring for the contract.

    A loss scale also reads as its current value wherever a scalar float32
    tensor would (`float(scale)`, `tf.convert_to_tensor(scale)`,
    `tf.keras.backend.get_value(scale)`): see `tf_lossscale.loss_scales.scale_reading`.

    Subclasses create their state variables in `__init__` with
    `_add_state_variable`, which also names them for checkpoints.
    """

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
          `(update_op, should_apply_gradients)`: `update_op` is None eagerly
          and an `Operation` in graph code; `should_apply_gradients` is a
          Python bool or scalar bool tensor, False if this step's gradients
          must not be applied.
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
        """Raises, before anything is assigned, unless each of `values` can
        be assigned exactly to its variable: the shape, a number, and for
        counters a whole number an int64 holds
        (`tf_lossscale.loss_scales.failure_policy.check_loadable`). Whether the state
        is one the rule can reach is checked at the next step.

        Args:
          values: one per variable of `variables`, in order, as a file
            stored them; None for one the file does not hold.

        Raises:
          TypeError, ValueError: naming the variable and the value.
        """
        names = {id(v): name for name, v in
                 getattr(self, "_state_variables", {}).items()}
        failure_policy.check_loadable(
            [((names.get(id(v), v.name), v), value)
             for v, value in zip(self.variables, values)
             if value is not None])

    def _add_state_variable(self, name, initial_value, dtype):
        variable = tf.Variable(
            initial_value,
            name=name,
            dtype=dtype,
            trainable=False,
            synchronization=tf.VariableSynchronization.AUTO,
            # The state is set once per step from a value every replica
            # agrees on; summing or averaging it across replicas is wrong.
            aggregation=tf.VariableAggregation.NONE,
        )
        self._state_variables[name] = variable
        private_api.track(self, variable, name)
        return variable


class FixedLossScale(LossScale):
    """A loss scale that never changes.

    By default, as in TensorFlow, `update` never asks to skip a step: every
    step's gradients are applied, non-finite ones included, and no finiteness
    check is computed at all. With `skip_non_finite=True` a step whose
    gradients are not all finite (on any replica) is skipped, still without
    ever changing the scale: the check-only mode for `mixed_bfloat16`, whose
    range needs no scaling but whose weights a NaN batch would still ruin
    (`FixedLossScale(1, skip_non_finite=True)`).

    Args:
      loss_scale_value: a Python int or float >= 1 that fits in float32.
      skip_non_finite: keyword-only bool; True skips non-finite steps.

    Raises:
      TypeError: `loss_scale_value` is a bool or not a number, or
        `skip_non_finite` is not a bool.
      ValueError: `loss_scale_value` is < 1, NaN, inf or beyond float32.
    """

    def __init__(self, loss_scale_value, *, skip_non_finite=False):
        value = checks.finite_float32(
            "loss_scale_value", loss_scale_value, at_least=1)
        skip = checks.boolean("skip_non_finite", skip_non_finite)
        super().__init__()
        # A Python float, not a tensor: a tensor made here could end up on
        # another device or in another graph than where it is used.
        self._loss_scale_value = value
        self._skip_non_finite = skip

    @property
    def loss_scale_value(self):
        return self._loss_scale_value

    @property
    def skip_non_finite(self):
        return self._skip_non_finite

    @property
    def _needs_finiteness(self):
        """Whether `update` looks at the gradients at all."""
        return self._skip_non_finite

    def __call__(self):
        return tf.constant(self._loss_scale_value, dtype=tf.float32)

    def update(self, grads):
        if not self._skip_non_finite:
            return graph_op(tf.no_op()), True
        replicas.check_supported()
        return replicas.call_in_cross_replica_context(
            update_from_grads, self, grads)

    def _update_from_all_finite(self, all_finite, *, gated=True):
        """`update` given the all-replica finiteness flag (cross-replica).

        `gated` is accepted for the same call as `DynamicLossScale`'s; a
        fixed scale has no state, so `should_apply` never waits for anything.
        """
        del gated
        if not self._skip_non_finite:
            return graph_op(tf.no_op()), True
        return graph_op(tf.no_op()), tf.convert_to_tensor(all_finite)

    def get_config(self):
        config = {"loss_scale_value": self._loss_scale_value}
        if self._skip_non_finite:
            config["skip_non_finite"] = True
        return config

    def __repr__(self):
        skip = ", skip_non_finite=True" if self._skip_non_finite else ""
        return f"FixedLossScale({self._loss_scale_value!r}{skip})"

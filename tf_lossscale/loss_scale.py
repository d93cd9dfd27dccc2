"""Loss scales: the contract, a fixed scale and the dynamic algorithm.

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
workers agree on the result (see `tf_lossscale.distribution`).

The dynamic algorithm (`DynamicLossScale`), with state S (float32) and a
counter of good steps G (int64), both in non-trainable variables:

* finite step: if G + 1 >= increment_period, set S to S * multiplier when that
  product is finite in float32 (S never becomes inf) and reset G to 0;
  otherwise G += 1;
* non-finite step (any NaN, +Inf or -Inf): S = max(S / multiplier, 1), G = 0,
  and the step's gradients must be skipped.

Arithmetic is float32 throughout, in the same order as TensorFlow's
`tf.compat.v1.mixed_precision.DynamicLossScale`, so both give bit-identical
scales for every sequence of steps; variables carry the same checkpoint names
(`current_loss_scale`, `good_steps`) so checkpoints move freely between them.
"""

import abc

import tensorflow as tf

from tf_lossscale import distribution
from tf_lossscale import validation


def _graph_op(op):
    """`op` while building a graph; None when executing eagerly."""
    return None if tf.executing_eagerly() else op


class LossScale(tf.__internal__.tracking.Trackable, metaclass=abc.ABCMeta):
    """Abstract base of loss scales; see the module docstring for the contract.

    Subclasses create their state variables in `__init__` with
    `_add_state_variable`, which also names them for checkpoints.
    """

    # Whether `_update_from_all_finite` needs the all-finite flag; a loss
    # scale that never skips a step saves the optimizer from computing it.
    _needs_finiteness = True

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
        self._track_trackable(variable, name=name)
        return variable


class FixedLossScale(LossScale):
    """A loss scale that never changes.

    `update` never asks to skip a step: a fixed scale cannot react to an
    overflow, so, as in TensorFlow, every step's gradients are applied,
    non-finite ones included. Use `DynamicLossScale` to skip them.

    Args:
      loss_scale_value: a Python int or float >= 1 that fits in float32.

    Raises:
      TypeError: `loss_scale_value` is a bool or not a number.
      ValueError: `loss_scale_value` is < 1, NaN, inf or beyond float32.
    """

    def __init__(self, loss_scale_value):
        value = validation.finite_float32(
            "loss_scale_value", loss_scale_value, at_least=1)
        super().__init__()
        # A Python float, not a tensor: a tensor made here could end up on
        # another device or in another graph than where it is used.
        self._loss_scale_value = value

    @property
    def loss_scale_value(self):
        return self._loss_scale_value

    def __call__(self):
        return tf.constant(self._loss_scale_value, dtype=tf.float32)

    _needs_finiteness = False

    def update(self, grads):
        del grads  # A fixed scale ignores them.
        return _graph_op(tf.no_op()), True

    def _update_from_all_finite(self, all_finite):
        del all_finite  # A fixed scale ignores it.
        return _graph_op(tf.no_op()), True

    def get_config(self):
        return {"loss_scale_value": self._loss_scale_value}

    def __repr__(self):
        return f"FixedLossScale({self._loss_scale_value!r})"


def next_dynamic_state(scale, good_steps, is_finite, increment_period,
                       multiplier):
    """One step of the dynamic algorithm as a pure function of tensors.

    Args:
      scale: scalar float32 tensor, the current loss scale.
      good_steps: scalar int64 tensor, consecutive finite steps so far.
      is_finite: scalar bool tensor, whether this step's gradients are finite.
      increment_period: Python int >= 1.
      multiplier: Python float > 1.

    Returns:
      `(new_scale, new_good_steps)`, computed without branches so the same
      code runs eagerly, in graphs and under XLA.
    """
    multiplier = tf.constant(multiplier, tf.float32)
    grown = scale * multiplier
    period_reached = good_steps + 1 >= increment_period
    scale_if_finite = tf.where(
        tf.logical_and(period_reached, tf.math.is_finite(grown)), grown, scale)
    scale_if_not_finite = tf.maximum(scale / multiplier, 1.0)
    new_scale = tf.where(is_finite, scale_if_finite, scale_if_not_finite)
    new_good_steps = tf.where(
        tf.logical_and(is_finite, tf.logical_not(period_reached)),
        good_steps + 1, tf.zeros_like(good_steps))
    return new_scale, new_good_steps


class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients stay finite and backs off.

    See the module docstring for the exact algorithm. Create it under
    `strategy.scope()` to share it between replicas; `update` then works in
    cross-replica context and inside `strategy.run` of that strategy, and
    raises ValueError anywhere else. Created outside any scope, it holds
    plain variables and works with or without a strategy.

    Args:
      initial_loss_scale: the starting scale, a Python number > 0 that fits in
        float32. Start high (the default, 2**15, is about half the float16
        maximum): a scale that is too high comes down in a few steps, one
        that is too low takes `increment_period` steps per doubling.
      increment_period: grow the scale after this many consecutive finite
        steps; a positive int.
      multiplier: the factor to grow by and to divide by on overflow; a finite
        Python number > 1.

    Raises:
      TypeError: an argument is a bool or of the wrong type.
      ValueError: an argument is out of range, NaN or infinite, or the current
        strategy is one loss scaling cannot support.
    """

    def __init__(self, initial_loss_scale=2**15, increment_period=2000,
                 multiplier=2.0):
        initial = validation.finite_float32(
            "initial_loss_scale", initial_loss_scale, above=0)
        period = validation.positive_int("increment_period", increment_period)
        factor = validation.finite_float32("multiplier", multiplier, above=1)
        distribution.check_supported()
        super().__init__()
        self._strategy = distribution.strategy_in_use()
        self._initial_loss_scale = initial
        self._increment_period = period
        self._multiplier = factor
        self._current_loss_scale = self._add_state_variable(
            "current_loss_scale", initial, tf.float32)
        self._good_steps = self._add_state_variable(
            "good_steps", 0, tf.int64)

    @property
    def initial_loss_scale(self):
        return self._initial_loss_scale

    @property
    def increment_period(self):
        return self._increment_period

    @property
    def multiplier(self):
        return self._multiplier

    @property
    def good_steps(self):
        """Consecutive finite steps since the scale last changed (int64)."""
        return tf.convert_to_tensor(self._good_steps)

    def __call__(self):
        return tf.convert_to_tensor(self._current_loss_scale)

    def update(self, grads):
        distribution.check_supported()
        distribution.check_same_strategy("This DynamicLossScale",
                                         self._strategy)
        return distribution.call_in_cross_replica_context(
            self._update_cross_replica, grads)

    def _update_cross_replica(self, grads):
        return self._update_from_all_finite(
            distribution.all_replicas_finite(grads))

    def _update_from_all_finite(self, all_finite):
        # Cross-replica context; `all_finite` is the flag every replica
        # agrees on.
        return self._step(all_finite), all_finite

    def _step(self, is_finite):
        # Each variable is read once and both assignments use those reads, so
        # a TF1 graph cannot run one assignment before the other's read.
        new_scale, new_good_steps = next_dynamic_state(
            tf.convert_to_tensor(self._current_loss_scale),
            tf.convert_to_tensor(self._good_steps),
            is_finite, self._increment_period, self._multiplier)
        return _graph_op(tf.group(
            self._current_loss_scale.assign(new_scale, read_value=False),
            self._good_steps.assign(new_good_steps, read_value=False)))

    def get_config(self):
        return {
            "initial_loss_scale": self._initial_loss_scale,
            "increment_period": self._increment_period,
            "multiplier": self._multiplier,
        }

    def __repr__(self):
        config = (f"initial_loss_scale={self._initial_loss_scale!r}, "
                  f"increment_period={self._increment_period!r}, "
                  f"multiplier={self._multiplier!r}")
        if tf.executing_eagerly():
            state = (f"current_loss_scale={float(self())!r}, "
                     f"good_steps={int(self.good_steps)!r}, ")
            return f"DynamicLossScale({state}{config})"
        return f"DynamicLossScale({config})"

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
workers agree on the result (see `tf_lossscale.distribution`). The built-in
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

The dynamic algorithm (`DynamicLossScale`). State: the scale S (float32), the
count of good steps G (int64) and, only when a feature needs them, the
hysteresis budget H (int64, starts at `hysteresis`) and the count of
consecutive skipped steps C (int64, starts at 0). Per step, all of it changes
together:

* finite step: C = 0; if `consecutive_hysteresis`, H = hysteresis.
  If G + 1 >= increment_period: S = min(S * multiplier, max_loss_scale) when
  S * multiplier is finite in float32 (otherwise S is unchanged), G = 0 and
  H = hysteresis. Otherwise G = G + 1.
* non-finite step (any NaN, +Inf or -Inf; the step must be skipped): G = 0,
  C = C + 1, H = max(H - 1, 0). If H == 0 a back-off is due:
  S = max(S * backoff_factor, min_loss_scale), or
  max(S / multiplier, min_loss_scale) when `backoff_factor` is None. If S was
  already at the floor (S <= min_loss_scale) when the back-off was due,
  `on_min_loss_scale` decides: "continue" does nothing more, "warn" prints
  one line to stderr, "raise" fails the step. Then, if `max_consecutive_skips`
  is set and C >= max_consecutive_skips, the step fails.

Without H (hysteresis=1) every non-finite step backs off. A failing step has
already recorded itself in the state (it was skipped); the failure is a
`tf.errors.InvalidArgumentError`, raised eagerly or by an assertion op in
graphs. Before any of this, a state that cannot be right (S not finite or
<= 0, G < 0, H outside [0, hysteresis], C < 0), for instance restored from a
damaged checkpoint or file or assigned by hand, fails the step with an
InvalidArgumentError naming every state variable and its value, and no
variable changes (`tf_lossscale.failure_policy`: the check, the policy and
their messages).

With its default arguments the rule is TensorFlow's
`tf.compat.v1.mixed_precision.DynamicLossScale`: arithmetic is float32
throughout, in the same order, so both give bit-identical scales for every
sequence of steps; the state is the same two variables under the same
checkpoint names (`current_loss_scale`, `good_steps`) and `get_config()` the
same three keys, so checkpoints and configs move freely between them. The
extra variables are `hysteresis_remaining` and `consecutive_skips`; non-default
arguments appear in `get_config()`.

Under XLA (`jit_compile=True`), where a step can neither fail nor print, the
step records what the state check and the policy ask for
(`tf_lossscale.xla_record`) and the host acts on it with the same errors and
warnings (`tf_lossscale.xla_checks`): after each call when the policy asks
for failures or warnings (a watcher is then required), and otherwise at the
next eager read of the scale or the end of Keras' `fit`.
"""

import abc
from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_lossscale import distribution
from tf_lossscale import eager_lock
from tf_lossscale import failure_policy
from tf_lossscale import scale_reading
from tf_lossscale import validation
from tf_lossscale import xla_checks
from tf_lossscale import xla_record

POLICIES = failure_policy.POLICIES
WARNING_PREFIX = failure_policy.WARNING_PREFIX


class _DefaultFloor(float):
    """The type of `min_loss_scale`'s default: 1.0, but told from an explicit 1.0.

    Only an explicit floor above `initial_loss_scale` is an error; with the
    default one, an initial scale below 1 keeps TensorFlow's behaviour.
    """

    __slots__ = ()


_DEFAULT_MIN_LOSS_SCALE = _DefaultFloor(1.0)


def _graph_op(op):
    """`op` while building a graph; None when executing eagerly."""
    return None if tf.executing_eagerly() else op


def _update_from_grads(loss_scale, grads):
    """Cross-replica context: the shared finiteness flag drives the update.

    In a TF1 graph, `should_apply` is not gated (module docstring): there the
    caller picks what a `Session` runs, and evaluating the flag must not need
    the state variables, as with TensorFlow's reference. Inside a
    `tf.function` every stateful op runs anyway, so gating costs nothing and
    keeps a branch on the flag from running on a step that fails.
    """
    # pylint: disable=protected-access
    return loss_scale._update_from_all_finite(
        distribution.all_replicas_finite(grads),
        gated=tf.compat.v1.executing_eagerly_outside_functions())


class LossScale(scale_reading.ReadsAsTensor, tf.__internal__.tracking.Trackable,
                metaclass=abc.ABCMeta):
    """Abstract base of loss scales; see the module docstring for the contract.

    A loss scale also reads as its current value wherever a scalar float32
    tensor would (`float(scale)`, `tf.convert_to_tensor(scale)`,
    `tf.keras.backend.get_value(scale)`): see `tf_lossscale.scale_reading`.

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
        (`tf_lossscale.failure_policy.check_loadable`). Whether the state
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
        self._track_trackable(variable, name=name)
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
        value = validation.finite_float32(
            "loss_scale_value", loss_scale_value, at_least=1)
        skip = validation.boolean("skip_non_finite", skip_non_finite)
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
            return _graph_op(tf.no_op()), True
        distribution.check_supported()
        return distribution.call_in_cross_replica_context(
            _update_from_grads, self, grads)

    def _update_from_all_finite(self, all_finite, *, gated=True):
        """`update` given the all-replica finiteness flag (cross-replica).

        `gated` is accepted for the same call as `DynamicLossScale`'s; a
        fixed scale has no state, so `should_apply` never waits for anything.
        """
        del gated
        if not self._skip_non_finite:
            return _graph_op(tf.no_op()), True
        return _graph_op(tf.no_op()), tf.convert_to_tensor(all_finite)

    def get_config(self):
        config = {"loss_scale_value": self._loss_scale_value}
        if self._skip_non_finite:
            config["skip_non_finite"] = True
        return config

    def __repr__(self):
        skip = ", skip_non_finite=True" if self._skip_non_finite else ""
        return f"FixedLossScale({self._loss_scale_value!r}{skip})"


class DynamicRule(NamedTuple):
    """The parameters of the dynamic algorithm that shape a step."""
    increment_period: int
    multiplier: float
    backoff_factor: Optional[float] = None
    min_loss_scale: float = 1.0
    max_loss_scale: Optional[float] = None
    hysteresis: int = 1
    consecutive_hysteresis: bool = False


class DynamicState(NamedTuple):
    """Scalar tensors: S, G and, when they exist, H and C."""
    scale: tf.Tensor
    good_steps: tf.Tensor
    hysteresis_remaining: Optional[tf.Tensor] = None
    consecutive_skips: Optional[tf.Tensor] = None


def next_dynamic_state(state, is_finite, rule):
    """One step of the dynamic algorithm as a pure function of tensors.

    Args:
      state: the current `DynamicState`; H and C may be None (not tracked).
      is_finite: scalar bool tensor, whether this step's gradients are finite.
      rule: a `DynamicRule`.

    Returns:
      `(new_state, backoff_at_floor)`: the next `DynamicState` (None where
      `state` has None) and a bool tensor, True when a back-off was due while
      S was already <= min_loss_scale. Computed without branches, so the
      same code runs eagerly, in graphs and under XLA.
    """
    scale, good_steps = state.scale, state.good_steps
    multiplier = tf.constant(rule.multiplier, tf.float32)
    floor = tf.constant(rule.min_loss_scale, tf.float32)

    grown = scale * multiplier
    period_reached = good_steps + 1 >= rule.increment_period
    grows = tf.logical_and(period_reached, tf.math.is_finite(grown))
    if rule.max_loss_scale is not None:
        grown = tf.minimum(grown, tf.constant(rule.max_loss_scale, tf.float32))
    scale_if_finite = tf.where(grows, grown, scale)

    if rule.backoff_factor is None:
        shrunk = scale / multiplier  # TensorFlow's arithmetic, bit for bit.
    else:
        shrunk = scale * tf.constant(rule.backoff_factor, tf.float32)
    backed_off = tf.maximum(shrunk, floor)

    budget = state.hysteresis_remaining
    if budget is None:
        backoff_due = tf.logical_not(is_finite)
        scale_if_not_finite = backed_off
        new_budget = None
    else:
        budget_after_skip = tf.maximum(budget - 1, 0)
        budget_used_up = tf.equal(budget_after_skip, 0)
        backoff_due = tf.logical_and(tf.logical_not(is_finite), budget_used_up)
        scale_if_not_finite = tf.where(budget_used_up, backed_off, scale)
        full = tf.constant(rule.hysteresis, budget.dtype)
        refilled = full if rule.consecutive_hysteresis else tf.where(
            period_reached, full, budget)
        new_budget = tf.where(is_finite, refilled, budget_after_skip)

    new_scale = tf.where(is_finite, scale_if_finite, scale_if_not_finite)
    new_good_steps = tf.where(
        tf.logical_and(is_finite, tf.logical_not(period_reached)),
        good_steps + 1, tf.zeros_like(good_steps))
    skips = state.consecutive_skips
    new_skips = None if skips is None else tf.where(
        is_finite, tf.zeros_like(skips), skips + 1)
    at_floor = tf.logical_and(backoff_due, scale <= floor)
    return DynamicState(new_scale, new_good_steps, new_budget,
                        new_skips), at_floor


def _check_rule_bounds(initial, floor, floor_is_explicit, ceiling):
    """The cross-argument checks, on the float32 values the state will hold."""
    as_f32 = np.float32
    if floor_is_explicit and as_f32(floor) > as_f32(initial):
        raise ValueError(
            f"min_loss_scale must be <= initial_loss_scale, got "
            f"min_loss_scale={floor!r} and initial_loss_scale={initial!r}")
    if ceiling is None:
        return
    if as_f32(ceiling) < as_f32(initial):
        raise ValueError(
            f"max_loss_scale must be >= initial_loss_scale, got "
            f"max_loss_scale={ceiling!r} and initial_loss_scale={initial!r}")
    if as_f32(ceiling) < as_f32(floor):
        which = "" if floor_is_explicit else " (its default)"
        raise ValueError(
            f"max_loss_scale must be >= min_loss_scale, got "
            f"max_loss_scale={ceiling!r} and min_loss_scale={floor!r}{which}")


class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients stay finite and backs off.

    See the module docstring for the exact rule. With the first three
    arguments only, it is TensorFlow's rule, bit for bit. Create it under
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
        steps; a positive int (a whole float such as 2.0 is taken).
      multiplier: the factor to grow by and, unless `backoff_factor` is
        given, to divide by on a back-off; a finite Python number > 1.
      backoff_factor: keyword-only; the factor a back-off multiplies the
        scale by, in (0, 1). None (the default) divides by `multiplier`.
      min_loss_scale: keyword-only; the floor no back-off goes below, a
        finite number > 0 (below 1 is allowed, for models whose float16 loss
        overflows even at scale 1). Default 1.0. An explicit floor above
        `initial_loss_scale` is a ValueError; with the default floor an
        initial scale below 1 backs off to 1, as in TensorFlow.
      max_loss_scale: keyword-only; a ceiling growth is clamped to, >=
        `initial_loss_scale` and >= `min_loss_scale`. None (the default):
        growth only stops where the scale would overflow float32.
      hysteresis: keyword-only; how many non-finite steps it takes to back
        off, a positive int. Every non-finite step is skipped; the scale
        only backs off once this budget is used up. 1 (the default) backs
        off on every non-finite step, as TensorFlow does.
      consecutive_hysteresis: keyword-only bool. False (the default): the
        hysteresis budget is refilled only when the growth period completes.
        True: every finite step refills it, so only that many non-finite
        steps *in a row* back off.
      on_min_loss_scale: keyword-only; what happens when a back-off is due
        while the scale is already at `min_loss_scale`: "continue" (the
        default: stay at the floor and skip the step), "warn" (the same,
        plus one line starting "tf_lossscale WARNING:" on stderr each time,
        also inside `tf.function` and `fit`) or "raise" (the step is skipped
        and recorded, then fails with `tf.errors.InvalidArgumentError`
        naming the floor, the scale and the count of steps skipped in a row).
      max_consecutive_skips: keyword-only; None (the default) or a positive
        int: when this many steps in a row were non-finite, the step fails
        like "raise", naming the count and the scale.

    Under XLA (`jit_compile`) a step can neither fail nor print, so the
    host raises and warns for it, with the same messages (the XLA guide;
    `tf_lossscale.xla_checks`):

    * with "warn", "raise" or `max_consecutive_skips`, the step can only be
      traced while a watcher is live: `tf_lossscale.XlaChecks()` or
      `LossScaleMonitor()` in `fit`'s callbacks, or
      `tf_lossscale.with_xla_checks` around a custom step or
      `model.train_on_batch`; otherwise the trace raises a RuntimeError
      naming these fixes. The watcher acts after each call;
    * otherwise (the default) no watcher is needed. A state the check
      refuses halts training (every later step changes nothing) and its
      InvalidArgumentError is raised at the next eager read of the scale
      (`loss_scale()`, `optimizer.dynamic_scale`), at the end of `fit`
      (`finalize_variable_values`) or by a watcher, whichever comes first.

    Threads: eagerly, each update (`update`, or an optimizer's step updating
    the scale) reads and writes the whole state under a lock, so updates from
    several threads at once are not lost: N threads doing M updates each
    leave the state of N*M updates in a row (in an order no one chooses). It
    costs nothing measurable (`benchmarks/loss_scale_benchmark.py
    --only=checks`).
    TensorFlow's own `DynamicLossScale` loses such updates. Inside a
    `tf.function`, under XLA and in TF1 graphs nothing is locked: run one
    step at a time on a loss scale there, as with any TensorFlow variables.
    The optimizers' steps are not made thread-safe by this: one optimizer
    serves one training loop.

    Raises:
      TypeError: an argument is a bool where a number is expected, or of the
        wrong type.
      ValueError: an argument is out of range, NaN or infinite, the bounds
        contradict each other, or the current strategy is one loss scaling
        cannot support.
    """

    def __init__(self, initial_loss_scale=2**15, increment_period=2000,
                 multiplier=2.0, *, backoff_factor=None,
                 min_loss_scale=_DEFAULT_MIN_LOSS_SCALE, max_loss_scale=None,
                 hysteresis=1, consecutive_hysteresis=False,
                 on_min_loss_scale="continue", max_consecutive_skips=None):
        initial = validation.finite_float32(
            "initial_loss_scale", initial_loss_scale, above=0)
        period = validation.positive_int("increment_period", increment_period)
        factor = validation.finite_float32("multiplier", multiplier, above=1)
        if backoff_factor is not None:
            backoff_factor = validation.finite_float32(
                "backoff_factor", backoff_factor, above=0, below=1)
        floor_is_explicit = min_loss_scale is not _DEFAULT_MIN_LOSS_SCALE
        floor = validation.finite_float32(
            "min_loss_scale", min_loss_scale, above=0)
        if max_loss_scale is not None:
            max_loss_scale = validation.finite_float32(
                "max_loss_scale", max_loss_scale, above=0)
        _check_rule_bounds(initial, floor, floor_is_explicit, max_loss_scale)
        budget = validation.positive_int("hysteresis", hysteresis)
        consecutive = validation.boolean(
            "consecutive_hysteresis", consecutive_hysteresis)
        policy = validation.one_of(
            "on_min_loss_scale", on_min_loss_scale, POLICIES)
        skip_limit = validation.optional_positive_int(
            "max_consecutive_skips", max_consecutive_skips)
        distribution.check_supported()
        super().__init__()
        self._eager_lock = eager_lock.EagerLock()
        self._strategy = distribution.strategy_in_use()
        self._initial_loss_scale = initial
        self._rule = DynamicRule(
            increment_period=period, multiplier=factor,
            backoff_factor=backoff_factor, min_loss_scale=floor,
            max_loss_scale=max_loss_scale, hysteresis=budget,
            consecutive_hysteresis=consecutive)
        self._on_min_loss_scale = policy
        self._max_consecutive_skips = skip_limit
        # Variable order is part of the saved format (.keras files store the
        # loss scale's variables by index): new state goes last.
        self._current_loss_scale = self._add_state_variable(
            "current_loss_scale", initial, tf.float32)
        self._good_steps = self._add_state_variable(
            "good_steps", 0, tf.int64)
        self._hysteresis_remaining = None
        if budget > 1:
            self._hysteresis_remaining = self._add_state_variable(
                "hysteresis_remaining", budget, tf.int64)
        self._consecutive_skips = None
        if policy != "continue" or skip_limit is not None:
            self._consecutive_skips = self._add_state_variable(
                "consecutive_skips", 0, tf.int64)
        # Not state: never saved (see tf_lossscale.xla_record).
        self._xla_record = xla_record.StepRecord(
            self._state_variables, floor,
            budget if self._hysteresis_remaining is not None else None,
            policy, skip_limit)

    @property
    def initial_loss_scale(self):
        return self._initial_loss_scale

    @property
    def increment_period(self):
        return self._rule.increment_period

    @property
    def multiplier(self):
        return self._rule.multiplier

    @property
    def backoff_factor(self):
        return self._rule.backoff_factor

    @property
    def min_loss_scale(self):
        return self._rule.min_loss_scale

    @property
    def max_loss_scale(self):
        return self._rule.max_loss_scale

    @property
    def hysteresis(self):
        return self._rule.hysteresis

    @property
    def consecutive_hysteresis(self):
        return self._rule.consecutive_hysteresis

    @property
    def on_min_loss_scale(self):
        return self._on_min_loss_scale

    @property
    def max_consecutive_skips(self):
        return self._max_consecutive_skips

    @property
    def good_steps(self):
        """Consecutive finite steps since the scale last changed (int64)."""
        return tf.convert_to_tensor(self._good_steps)

    @property
    def _needs_finiteness(self):
        return True

    def __call__(self):
        """The current scale; eagerly, first raises what XLA steps left to
        the host (`tf_lossscale.xla_checks.act`: one small read, only once
        a step has been traced under XLA)."""
        xla_checks.act(self)
        return tf.convert_to_tensor(self._current_loss_scale)

    def update(self, grads):
        """`LossScale.update`; in a TF1 graph `should_apply_gradients` comes
        from `grads` alone and only `update_op` checks and moves the state
        (module docstring)."""
        distribution.check_supported()
        return distribution.call_in_cross_replica_context(
            _update_from_grads, self, grads)

    @eager_lock.one_thread_at_a_time
    def _update_from_all_finite(self, all_finite, *, gated=True):
        """One step from the flag every replica agrees on.

        Called in cross-replica context (or without a strategy). Checks the
        state, moves it on, then applies the failure policy. Returns
        `(update_op, should_apply)` as `update` does. Eagerly, one thread at
        a time (see the class docstring).

        Args:
          all_finite: scalar bool tensor, the all-replica finiteness flag.
          gated: keyword-only; matters in graphs only. True (the default,
            for optimizers): `should_apply` runs only after the state check,
            the assignments and the policy, so a branch on it cannot apply a
            step that failed. False (`update` in a TF1 graph): `should_apply`
            is `all_finite` itself, evaluable without the state variables;
            `update_op` alone carries the check, assignments and policy.
        """
        # Here rather than in `update`: an optimizer computes the flag itself
        # and calls this directly.
        distribution.check_same_strategy("This DynamicLossScale",
                                         self._strategy)
        all_finite = tf.convert_to_tensor(all_finite)
        state = self._read_state()
        if xla_record.in_xla_context():
            return self._xla_record.update(
                state, all_finite,
                failure_policy.state_is_valid(state, self._rule.hysteresis),
                lambda s, f: next_dynamic_state(s, f, self._rule),
                self._assign_state)
        state_check = failure_policy.check_state(state, self._rule.hysteresis)
        with tf.control_dependencies(_ops(state_check)):
            new_state, at_floor = next_dynamic_state(
                state, all_finite, self._rule)
            assignments = self._assign_state(new_state)
        with tf.control_dependencies(assignments):
            failures = failure_policy.apply_policy(
                new_state, at_floor, self._rule.min_loss_scale,
                self._on_min_loss_scale, self._max_consecutive_skips)
        if tf.executing_eagerly():
            return None, all_finite
        # The assignments wait for the state check, so running update_op
        # runs the check first.
        update_op = tf.group(assignments + failures)
        if not gated:
            return update_op, all_finite
        with tf.control_dependencies(
                _ops(state_check) + assignments + failures):
            should_apply = tf.identity(all_finite)
        return update_op, should_apply

    def _state_variables_in_order(self):
        return (self._current_loss_scale, self._good_steps,
                self._hysteresis_remaining, self._consecutive_skips)

    def _read_state(self):
        # Each variable is read once and every assignment uses those reads,
        # so a TF1 graph cannot run one assignment before another's read.
        return DynamicState(*(
            None if variable is None else tf.convert_to_tensor(variable)
            for variable in self._state_variables_in_order()))

    def _assign_state(self, new_state):
        assignments = [
            variable.assign(value, read_value=False)
            for variable, value in zip(self._state_variables_in_order(),
                                       new_state)
            if variable is not None
        ]
        return [] if tf.executing_eagerly() else assignments

    def get_config(self):
        config = {
            "initial_loss_scale": self._initial_loss_scale,
            "increment_period": self._rule.increment_period,
            "multiplier": self._rule.multiplier,
        }
        # Defaults stay out, so a default config is TensorFlow's.
        optional = {
            "backoff_factor": (self._rule.backoff_factor, None),
            "min_loss_scale": (self._rule.min_loss_scale, 1.0),
            "max_loss_scale": (self._rule.max_loss_scale, None),
            "hysteresis": (self._rule.hysteresis, 1),
            "consecutive_hysteresis": (self._rule.consecutive_hysteresis,
                                       False),
            "on_min_loss_scale": (self._on_min_loss_scale, "continue"),
            "max_consecutive_skips": (self._max_consecutive_skips, None),
        }
        for name, (value, default) in optional.items():
            if value != default:
                config[name] = value
        return config

    def __repr__(self):
        config = ", ".join(
            f"{name}={value!r}" for name, value in self.get_config().items())
        if tf.executing_eagerly():
            # The variables, not `self()`: a repr must not raise.
            state = (f"current_loss_scale="
                     f"{float(self._current_loss_scale.numpy())!r}, "
                     f"good_steps={int(self._good_steps.numpy())!r}, ")
            return f"DynamicLossScale({state}{config})"
        return f"DynamicLossScale({config})"


def _ops(op):
    """[op] for an op or tensor, [] for None (eagerly, nothing to wait on)."""
    return [] if op is None else [op]

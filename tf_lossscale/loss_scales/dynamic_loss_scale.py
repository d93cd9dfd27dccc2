"""`DynamicLossScale`: the dynamic rule held in variables.

The rule is `dynamic_rule`; the state check and the failure policy are
`failure_policy`. Under XLA, where a step can neither fail nor print, the step
records what they ask for (`xla_record`) and the host acts on it
(`xla_checks`). Eagerly, each update holds a lock, so threads sharing one
loss scale lose no update; graphs are not locked.
"""

import contextlib
import threading

import tensorflow as tf

from tf_lossscale.loss_scales import dynamic_rule
from tf_lossscale.loss_scales import failure_policy
from tf_lossscale.loss_scales import loss_scale
from tf_lossscale.loss_scales import xla_checks
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.ops import replicas


class _EagerLock:
    """A lock that copies as a new one: a copied loss scale has its own state.

    Eagerly an update is several ops that release the GIL, so two threads
    could read one state and lose an update (TensorFlow's own class does).
    """

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *exc_info):
        return self._lock.__exit__(*exc_info)

    def __reduce__(self):
        return (_EagerLock, ())


def _checked(holder, name):
    """A read-only property: the checked argument `name`, read from the
    `DynamicRule` (holder "_rule") or the `DynamicArguments` ("_arguments")."""
    return property(lambda self: getattr(getattr(self, holder), name),
                    doc=f"The `{name}` argument, as checked.")


class DynamicLossScale(loss_scale.LossScale):
    """A loss scale that grows while gradients stay finite and backs off.

    The exact rule is in `tf_lossscale.loss_scales.dynamic_rule`; with the
    first three arguments only, it is TensorFlow's, bit for bit. Create it under
    `strategy.scope()` to share it between replicas; `update` then works in
    cross-replica context and inside `strategy.run` of that strategy, and
    raises ValueError anywhere else. Created outside any scope, it holds
    plain variables and works with or without a strategy.

    Args (what each does, and why: docs/guides/tuning.md):
      initial_loss_scale: the starting scale, a number > 0 that fits in
        float32; default 2**15.
      increment_period: grow after this many consecutive finite steps; a
        positive int (a whole float such as 2.0 is taken).
      multiplier: the growth factor and, without `backoff_factor`, the
        back-off's divisor; a finite number > 1.
      backoff_factor: keyword-only; the back-off's factor, in (0, 1); None
        (the default) divides by `multiplier`.
      min_loss_scale: keyword-only; the floor of back-offs, a finite number
        > 0, default 1.0. An explicit floor above `initial_loss_scale` is a
        ValueError; with the default one an initial scale below 1 backs off
        to 1, as in TensorFlow.
      max_loss_scale: keyword-only; the ceiling growth is clamped to, >=
        `initial_loss_scale` and `min_loss_scale`; None (the default): only
        float32's overflow stops growth.
      hysteresis: keyword-only; the non-finite steps (each skipped) it takes
        to back off, a positive int; 1 (the default) as TensorFlow.
      consecutive_hysteresis: keyword-only bool; True: every finite step
        refills the hysteresis budget; False (the default): a growth does.
      on_min_loss_scale: keyword-only; a back-off due at `min_loss_scale`:
        "continue" (the default: stay and skip the step), "warn" (the same,
        and a "tf_lossscale WARNING:" line on stderr each time, in
        `tf.function` and `fit` too) or "raise" (the step is skipped, then
        fails with `tf.errors.InvalidArgumentError` naming the floor, the
        scale and the steps skipped in a row).
      max_consecutive_skips: keyword-only; None (the default) or a positive
        int: that many non-finite steps in a row fail like "raise".

    Raises:
      TypeError: an argument is a bool where a number is expected, or of the
        wrong type.
      ValueError: an argument is out of range, NaN or infinite, the bounds
        contradict each other, or the current strategy is one loss scaling
        cannot support.
    """

    def __init__(self, initial_loss_scale=2**15, increment_period=2000,
                 multiplier=2.0, *, backoff_factor=None,
                 min_loss_scale=dynamic_rule.DEFAULT_MIN_LOSS_SCALE,
                 max_loss_scale=None,
                 hysteresis=1, consecutive_hysteresis=False,
                 on_min_loss_scale="continue", max_consecutive_skips=None):
        arguments = dynamic_rule.checked_arguments(
            initial_loss_scale, increment_period, multiplier, backoff_factor,
            min_loss_scale, max_loss_scale, hysteresis,
            consecutive_hysteresis, on_min_loss_scale, max_consecutive_skips)
        rule = arguments.rule
        replicas.check_supported()
        super().__init__()
        self._eager_lock = _EagerLock()
        self._strategy = replicas.strategy_in_use()
        self._arguments = arguments
        self._rule = rule
        # Variable order is part of the saved format (.keras files store the
        # loss scale's variables by index): new state goes last.
        self._current_loss_scale = self._add_state_variable(
            "current_loss_scale", arguments.initial_loss_scale, tf.float32)
        self._good_steps = self._add_state_variable(
            "good_steps", 0, tf.int64)
        if rule.hysteresis > 1:
            self._add_state_variable(
                "hysteresis_remaining", rule.hysteresis, tf.int64)
        if failure_policy.needs_host(arguments.on_min_loss_scale,
                                     arguments.max_consecutive_skips):
            self._add_state_variable("consecutive_skips", 0, tf.int64)
        # Not state: never saved.
        self._xla_record = xla_record.StepRecord(
            self._state_variables, rule.min_loss_scale, rule.hysteresis,
            arguments.on_min_loss_scale, arguments.max_consecutive_skips)

    initial_loss_scale = _checked("_arguments", "initial_loss_scale")
    increment_period = _checked("_rule", "increment_period")
    multiplier = _checked("_rule", "multiplier")
    backoff_factor = _checked("_rule", "backoff_factor")
    min_loss_scale = _checked("_rule", "min_loss_scale")
    max_loss_scale = _checked("_rule", "max_loss_scale")
    hysteresis = _checked("_rule", "hysteresis")
    consecutive_hysteresis = _checked("_rule", "consecutive_hysteresis")
    on_min_loss_scale = _checked("_arguments", "on_min_loss_scale")
    max_consecutive_skips = _checked("_arguments", "max_consecutive_skips")

    @property
    def good_steps(self):
        """Consecutive finite steps since the scale last changed (int64)."""
        return tf.convert_to_tensor(self._good_steps)

    _needs_finiteness = True

    def __call__(self):
        """The current scale; eagerly, first raises what XLA steps left to
        the host (`xla_checks.act`: syncs, one small read, once a step of
        this loss scale has been traced under XLA)."""
        xla_checks.act(self)
        return tf.convert_to_tensor(self._current_loss_scale)

    def update(self, grads):
        """`LossScale.update`. In a TF1 graph `should_apply_gradients` comes
        from `grads` alone; only `update_op` checks and moves the state."""
        return loss_scale.update_from_grads(self, grads)

    def _update_from_all_finite(self, all_finite, *, gated=True):
        """One step from the flag every replica agrees on (cross-replica).

        Checks the state, moves it on, then applies the failure policy;
        returns `(update_op, should_apply)` as `update` does. `gated`
        (graphs only): True makes `should_apply` wait for the check, the
        assignments and the policy, so a branch on it cannot apply a step
        that failed; False (`update` in a TF1 graph) returns `all_finite`
        itself, evaluable without the state variables.
        """
        lock = (self._eager_lock if tf.executing_eagerly()
                else contextlib.nullcontext())
        with lock:
            # Here, not in `update`: optimizers compute the flag themselves.
            replicas.check_same_strategy("This DynamicLossScale",
                                         self._strategy)
            return self._step(tf.convert_to_tensor(all_finite), gated)

    def _step(self, all_finite, gated):
        # Each variable is read once and every assignment uses those reads,
        # so a TF1 graph cannot run one assignment before another's read.
        state = dynamic_rule.DynamicState(*(
            None if variable is None else tf.convert_to_tensor(variable)
            for variable in self._state_variables_in_order()))
        if xla_record.in_xla_context():
            return self._xla_record.update(
                state, all_finite,
                failure_policy.state_is_valid(state, self._rule.hysteresis),
                lambda s, f: dynamic_rule.next_dynamic_state(s, f, self._rule),
                self._assign_state)
        state_check = failure_policy.check_state(state, self._rule.hysteresis)
        with tf.control_dependencies(failure_policy.ops_of(state_check)):
            new_state, at_floor = dynamic_rule.next_dynamic_state(
                state, all_finite, self._rule)
            assignments = self._assign_state(new_state)
        with tf.control_dependencies(assignments):
            failures = failure_policy.apply_policy(
                new_state, at_floor, self._rule.min_loss_scale,
                self._arguments.on_min_loss_scale,
                self._arguments.max_consecutive_skips)
        if tf.executing_eagerly():
            return None, all_finite
        # The assignments wait for the state check, so running update_op
        # runs the check first.
        update_op = tf.group(assignments + failures)
        if not gated:
            return update_op, all_finite
        with tf.control_dependencies(
                failure_policy.ops_of(state_check) + assignments + failures):
            should_apply = tf.identity(all_finite)
        return update_op, should_apply

    def _state_variables_in_order(self):
        """S, G, H and C (None for one not tracked)."""
        return [self._state_variables.get(name)
                for name in failure_policy.FIELDS]

    def _assign_state(self, new_state):
        assignments = [
            variable.assign(value, read_value=False)
            for variable, value in zip(self._state_variables_in_order(),
                                       new_state)
            if variable is not None
        ]
        return [] if tf.executing_eagerly() else assignments

    def get_config(self):
        return dynamic_rule.config_of(self._arguments)

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

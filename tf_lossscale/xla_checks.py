"""The failure policy and the state check under XLA, carried out on the host.

Inside an XLA-compiled step (`tf.function(jit_compile=True)`, and Keras'
`fit` when `jit_compile` is on, its default on GPUs) a step cannot fail or
print: XLA drops assertion ops and cannot compile string formatting. So
there a `DynamicLossScale` records what the policy asks for as a few integers
in a small variable of its own, `StepEvents` (not saved: not in
`LossScale.variables`, not a checkpoint dependency), and host-side code acts
on that record after each executed call, with the same error or warning as
without XLA:

* the state check: a scale that is not finite and > 0, or good_steps < 0,
  refuses the step (nothing changes) and raises InvalidArgumentError;
* "raise" and `max_consecutive_skips`: the failing step is recorded in the
  scale's state, as without XLA, then raises InvalidArgumentError;
* "warn": the same line on stderr.

Once a step has failed (or was refused), every later step changes nothing
either (no weight, slot, scale or counter) until the host has acted, so the
weights are those of the failing step when the error is raised; the only
latency is that the error comes at the end of the call that held the failing
step (at most `steps_per_execution - 1` steps later, which do nothing).
After the host acted the record is cleared, so training can be resumed, as
without XLA. Several warnings in one call print one line, with the last
one's values and how many there were.

Host-side code must be engaged when the step is compiled, or the step fails
before it ever runs, naming the fix. Keras' `fit` and `train_on_batch`
engage it by themselves: the step, while compiling inside the model's
`fit` or `train_on_batch`, wraps the model's `train_function` so the host
acts after each call (Keras offers an optimizer no hook for this, so the
call is found on the stack). `XlaChecks` or `LossScaleMonitor` in `fit`'s callbacks do the
same explicitly; a custom loop wraps its step with `with_xla_checks`.
"""

import contextlib
import functools
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import

WARNING_PREFIX = "tf_lossscale WARNING:"

INVALID_STATE = (
    "tf_lossscale: DynamicLossScale holds a state that cannot be right "
    "(restored from a checkpoint or assigned?): current_loss_scale must be "
    "finite and > 0 and good_steps >= 0; no variable was changed. Got")

NOT_ENGAGED = (
    "tf_lossscale: this training step is compiled with XLA (jit_compile) "
    "outside Keras' fit and train_on_batch. Inside XLA a step can neither "
    "fail nor print, so DynamicLossScale's state check and "
    "on_min_loss_scale/max_consecutive_skips run on the host after each "
    "call, and nothing is set up to run them: call the step through "
    "step = tf_lossscale.with_xla_checks(step, optimizer), or turn XLA off "
    "(jit_compile=False).")

# The Keras (3 and 2) model methods that run the compiled train step and
# then return to the host.
_TRAINING_METHODS = ("fit", "train_on_batch")

# Event codes of a failed or refused step.
_NONE, _INVALID, _AT_FLOOR, _TOO_MANY_SKIPS = 0, 1, 2, 3
# The record: [failure code, its scale's bits, its skips, its good_steps,
# warnings since the host last looked, the last warning's scale bits and
# skips]. Integers only: XLA on every device handles int64.
_CODE, _SCALE, _SKIPS, _GOOD, _WARNINGS, _WARN_SCALE, _WARN_SKIPS = range(7)
_SIZE = 7


def in_xla_context():
    """Whether ops built now are compiled by XLA (checked while tracing)."""
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())


def floor_template(floor, policy):
    """The message of a back-off due at the floor; `{}`: scale, skips."""
    if policy == "warn":
        return (f"{WARNING_PREFIX} a loss scale back-off was due but the "
                f"scale is already at min_loss_scale={floor!r} (current "
                "scale {}); steps skipped in a row for non-finite gradients: "
                "{}")
    return ("tf_lossscale: a loss scale back-off was due but the scale "
            f"is already at min_loss_scale={floor!r} (current scale {{}}); "
            "steps skipped in a row for non-finite gradients: {} "
            "(on_min_loss_scale=raise). The gradients overflow even at "
            "the smallest scale allowed: look for NaN/Inf in the data or "
            "the model, or lower min_loss_scale.")


def limit_template(limit):
    """The message of `max_consecutive_skips`; `{}`: skips, scale."""
    return ("tf_lossscale: steps skipped in a row for non-finite "
            f"gradients: {{}}, the limit set by max_consecutive_skips="
            f"{limit}; current loss scale {{}}.")


def invalid_state_message(scale, good_steps):
    return (f"{INVALID_STATE} current_loss_scale={float(scale)!r}, "
            f"good_steps={int(good_steps)}")


def _bits(scale):
    return tf.cast(tf.bitcast(scale, tf.int32), tf.int64)


def _values(scale, skips, good_steps):
    return tf.stack([_bits(scale), tf.cast(skips, tf.int64),
                     tf.cast(good_steps, tf.int64)])


def _from_bits(bits):
    return np.array(bits).astype(np.int32).view(np.float32)


class StepEvents:
    """What XLA-compiled steps of one `DynamicLossScale` left for the host.

    Args:
      floor, on_min_loss_scale, max_consecutive_skips: the loss scale's.
      strategy: the strategy the loss scale's variables belong to, or None.
    """

    def __init__(self, floor, on_min_loss_scale, max_consecutive_skips,
                 strategy=None):
        self._floor = floor
        self._policy = on_min_loss_scale
        self._limit = max_consecutive_skips
        self._strategy = strategy
        # Created when host-side checks are first engaged, which an XLA step
        # requires: runs that never engage them never hold it.
        self.record = None
        self._engaged = 0

    def _create_record(self):
        # Kept out of checkpoints and .keras files: it is cleared as soon as
        # the host acts on it, so there is nothing to resume from. Made
        # eagerly (engaging happens on the host, before the step is traced:
        # a tf.function may only create variables on its first call), beside
        # the loss scale's own variables.
        scope = (self._strategy.scope() if self._strategy is not None
                 else contextlib.nullcontext())
        with tf.init_scope(), scope:
            self.record = tf.Variable(
                tf.zeros([_SIZE], tf.int64), name="xla_step_events",
                trainable=False, aggregation=tf.VariableAggregation.NONE)

    # Device side, traced into the XLA step.

    def update(self, state, all_finite, valid, next_state, assign):
        """The scale's update under XLA; returns `(update_op, should_apply)`.

        Args:
          state: the `DynamicState` read this step.
          all_finite: the all-replica finiteness flag.
          valid: a bool tensor, whether `state` can be right.
          next_state: `next_state(state, all_finite) -> (new, at_floor)`.
          assign: `assign(new_state) -> assignment ops`.
        """
        if not self._engaged and not _engage_running_trainer(self):
            raise RuntimeError(NOT_ENGAGED)
        record = tf.convert_to_tensor(self.record)
        # A step after a failure, or on a state that cannot be right, changes
        # nothing: the host has not raised yet.
        proceed = tf.logical_and(valid, tf.equal(record[_CODE], _NONE))
        new_state, at_floor = next_state(state, all_finite)
        kept = type(state)(*(
            None if old is None else tf.where(proceed, new, old)
            for old, new in zip(state, new_state)))
        assignments = assign(kept)
        at_floor = tf.logical_and(proceed, at_floor)
        new_record = self._next_record(record, state, kept, proceed,
                                       at_floor)
        with tf.control_dependencies(assignments):
            written = self.record.assign(new_record)
        with tf.control_dependencies(assignments + [written]):
            should_apply = tf.logical_and(
                tf.logical_and(all_finite, proceed),
                tf.equal(new_record[_CODE], _NONE))
        return tf.group(assignments + [written]), should_apply

    def _next_record(self, record, state, new_state, proceed, at_floor):
        """The record after this step (int64 vector)."""
        skips = new_state.consecutive_skips
        if skips is None:  # Only "continue" without a limit lacks C.
            skips = tf.zeros([], tf.int64)
        code = self._failure_code(record[_CODE], proceed, at_floor, skips)
        # A new failure keeps the values after the step; a refusal the bad
        # state; an earlier failure its own values.
        refused_now = tf.logical_and(tf.equal(record[_CODE], _NONE),
                                     tf.logical_not(proceed))
        failed_now = tf.logical_and(proceed, tf.not_equal(code, _NONE))
        values = tf.where(
            refused_now, _values(state.scale, tf.zeros([], tf.int64),
                                 state.good_steps),
            tf.where(failed_now,
                     _values(new_state.scale, skips, new_state.good_steps),
                     record[_SCALE:_GOOD + 1]))
        warns = at_floor if self._policy == "warn" else tf.constant(False)
        warning = tf.where(
            warns,
            tf.stack([record[_WARNINGS] + 1, _bits(new_state.scale), skips]),
            record[_WARNINGS:])
        return tf.concat([code[None], values, warning], axis=0)

    def _failure_code(self, code, proceed, at_floor, skips):
        """The failure code after this step; an earlier one stays."""
        code = tf.where(tf.logical_and(tf.equal(code, _NONE),
                                       tf.logical_not(proceed)),
                        tf.constant(_INVALID, tf.int64), code)
        if self._limit is not None:
            code = tf.where(tf.logical_and(proceed, skips >= self._limit),
                            tf.constant(_TOO_MANY_SKIPS, tf.int64), code)
        if self._policy == "raise":  # Wins over the limit, as without XLA.
            code = tf.where(at_floor, tf.constant(_AT_FLOOR, tf.int64), code)
        return code

    def halted(self):
        """Whether the step just updated must neither apply nor be recorded
        as skipped (it failed or was refused); read after the update."""
        return tf.not_equal(tf.convert_to_tensor(self.record)[_CODE], _NONE)

    # Host side.

    @contextlib.contextmanager
    def engaged(self):
        """Steps compiled inside this context will have the host act."""
        if self.record is None:
            self._create_record()
        self._engaged += 1
        try:
            yield
        finally:
            self._engaged -= 1

    def act(self):
        """Warns and raises for what the steps since the last call recorded,
        then clears the record; one small read when nothing happened."""
        if self.record is None:
            return
        record = self.record.numpy()
        if not record.any():
            return
        self.record.assign(tf.zeros([_SIZE], tf.int64))
        if record[_WARNINGS]:
            self._warn(record)
        code = record[_CODE]
        scale = _from_bits(record[_SCALE])
        if code == _INVALID:
            raise tf.errors.InvalidArgumentError(
                None, None, invalid_state_message(scale, record[_GOOD]))
        if code == _AT_FLOOR:
            template = floor_template(self._floor, self._policy)
            values = ((scale, tf.float32), (record[_SKIPS], tf.int64))
        elif code == _TOO_MANY_SKIPS:
            template = limit_template(self._limit)
            values = ((record[_SKIPS], tf.int64), (scale, tf.float32))
        else:
            return
        raise tf.errors.InvalidArgumentError(
            None, None, _format(template, values))

    def _warn(self, record):
        line = _format(floor_template(self._floor, "warn"),
                       ((_from_bits(record[_WARN_SCALE]), tf.float32),
                        (record[_WARN_SKIPS], tf.int64)))
        earlier = int(record[_WARNINGS]) - 1
        if earlier:
            line += (f" (the last of {earlier + 1} such steps in one XLA "
                     "call)")
        print(line, file=sys.stderr, flush=True)


def _format(template, values):
    """`template` formatted as the step formats it without XLA (same text):
    `values` are (value, dtype) pairs."""
    tensors = [tf.constant(value, dtype) for value, dtype in values]
    return tf.strings.format(template, tensors).numpy().decode()


def events_of(target):
    """The `StepEvents` of a loss scale or optimizer's loss scale, or None
    for loss scales that need no host-side checks."""
    loss_scale = getattr(target, "loss_scale", target)
    return getattr(loss_scale, "_xla_events", None)


def halted(loss_scale):
    """None unless `loss_scale` has just been updated under XLA; then the
    bool tensor `StepEvents.halted`."""
    events = events_of(loss_scale)
    if events is None or not in_xla_context():
        return None
    return events.halted()


def check(target):
    """Host side, after a call that may have run XLA-compiled steps: raises
    or warns as the steps of `target` (an optimizer or loss scale) asked."""
    events = events_of(target)
    if events is not None:
        events.act()


@contextlib.contextmanager
def engaged(target):
    """Steps of `target` compiled in this context have the host act."""
    events = events_of(target)
    if events is None:
        yield
        return
    with events.engaged():
        yield


class HostChecks:
    """Engages the host-side checks of `target` until `close()`.

    For callbacks: create it when training begins, call `check()` after each
    call of the compiled step, `close()` when training ends. Creating it acts
    on whatever an earlier, unwatched call left behind.
    """

    def __init__(self, target):
        self._target = target
        self._context = engaged(target)
        self._context.__enter__()  # pylint: disable=unnecessary-dunder-call
        self.check()

    def check(self):
        try:
            check(self._target)
        except BaseException:
            # Keras does not end training when a callback raises.
            self.close()
            raise

    def close(self):
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)


def _running_trainer(events):
    """The Keras model (3 or 2) whose `fit` or `train_on_batch` is running,
    here compiling its step, with an optimizer holding `events`; and, inside
    its `fit`, that fit's callback list. (None, None) outside such a call."""
    frame = sys._getframe(2)  # pylint: disable=protected-access
    while frame is not None:
        model = frame.f_locals.get("self")
        if (frame.f_code.co_name in _TRAINING_METHODS and events_of(
                getattr(model, "optimizer", None)) is events):
            callbacks = frame.f_locals.get("callbacks")
            if not hasattr(callbacks, "on_train_batch_end"):
                callbacks = None
            return model, callbacks
        frame = frame.f_back
    return None, None


def _engage_running_trainer(events):
    """Engages the host side for a Keras `fit` or `train_on_batch` whose step
    is being compiled, without the user's help; False outside those.

    Keras offers no hook, so the model's `train_function` is wrapped with
    `with_xla_checks` (every later call: this fit's, later fits',
    `train_on_batch`'s), and the running fit checks before its callbacks
    see each batch. Steps of the call compiling now are checked at that
    fit's first batch end, or (`train_on_batch`) before the next call.
    """
    model, callbacks = _running_trainer(events)
    if model is None:
        return False
    if getattr(model.train_function, "_checks_xla_steps", False):
        return True  # Wrapped when the step was first compiled.
    if events.record is None:
        events._create_record()  # pylint: disable=protected-access
    optimizer = model.optimizer
    checked = with_xla_checks(model.train_function, optimizer)
    first_call = [True]

    @functools.wraps(model.train_function)
    def train_function(*args, **kwargs):
        if first_call:
            first_call.clear()
            check(optimizer)  # What the compiling call left.
        return checked(*args, **kwargs)

    train_function._checks_xla_steps = True  # pylint: disable=protected-access
    model.train_function = train_function
    if callbacks is not None:
        batch_end = callbacks.on_train_batch_end

        def on_train_batch_end(*args, **kwargs):
            check(optimizer)
            return batch_end(*args, **kwargs)

        # This fit's list only; synchronous, before any async dispatch.
        callbacks.on_train_batch_end = on_train_batch_end
    return True


def with_xla_checks(step, target):
    """Returns `step` made to run the host-side checks after each call.

    For custom training loops (and `model.train_on_batch`) whose step is
    compiled with XLA; harmless without XLA::

        train_step = tf_lossscale.with_xla_checks(
            tf.function(train_step, jit_compile=True), optimizer)

    Args:
      step: the callable that runs one or more training steps.
      target: the `tf_lossscale.LossScaleOptimizer` (or `LossScale`) it uses.
    """

    @functools.wraps(step)
    def checked_step(*args, **kwargs):
        with engaged(target):
            result = step(*args, **kwargs)
        check(target)
        return result

    return checked_step

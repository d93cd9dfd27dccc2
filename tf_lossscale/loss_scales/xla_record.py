"""The device side of the XLA checks: what a compiled step records.

Under XLA nothing can fail or print, so a `DynamicLossScale` writes what its
state check and failure policy ask for into a small int64 variable (not
state: never saved), and the host (`xla_checks`) acts on it later with the
same error or warning. After a failed or refused step every later one is
halted until the host has acted (docs/guides/xla.md).
"""

import threading
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from tf_lossscale.loss_scales import failure_policy
from tf_lossscale._internal import private_api

# Event codes of a failed or refused step. REFUSED: by the caller of the
# update (a `LossScaleGroup`), its message given by `refusal_message`.
NONE, INVALID, AT_FLOOR, TOO_MANY_SKIPS, REFUSED = 0, 1, 2, 3, 4
# The record: [failure code, then the values its message needs: S's bits, G,
# H, C; then warnings since the host last looked, the last warning's S bits
# and C]. Integers only: XLA on every device handles int64.
_CODE, _SCALE, _GOOD, _BUDGET, _SKIPS = range(5)
_WARNINGS, _WARN_SCALE, _WARN_SKIPS = range(5, 8)
_SIZE = 8


# Whether ops built now are compiled by XLA (checked while tracing).
in_xla_context = private_api.in_xla_context


class Recorded(NamedTuple):
    """A record read back on the host; the scales as Python floats."""
    code: int
    state: dict  # Refused state or failing step: {field: value}.
    values: tuple  # The four values behind `state`, as recorded.
    warnings: int
    warn_scale: float
    warn_skips: int


def _bits(scale):
    return tf.cast(tf.bitcast(scale, tf.int32), tf.int64)


def _scale_from_bits(bits):
    return float(np.array(bits).astype(np.int32).view(np.float32))


class StepRecord:
    """What XLA-compiled steps of one `DynamicLossScale` leave for the host.

    Args:
      fields: the names of the loss scale's state variables
        (`failure_policy.FIELDS`, H and C only when tracked).
      floor, hysteresis, policy, limit: the loss scale's `min_loss_scale`,
        `hysteresis`, `on_min_loss_scale` and `max_consecutive_skips`, for
        the messages.
    """

    def __init__(self, fields, floor, hysteresis, policy, limit):
        self.fields = tuple(fields)
        self.floor = floor
        self.hysteresis = hysteresis
        self.policy = policy
        self.limit = limit
        self.needs_host = failure_policy.needs_host(policy, limit)
        # Set once a step of this loss scale has been traced under XLA: only
        # then can the record hold anything, so host moments read it only
        # then.
        self.traced = False
        self.variable = None
        if tf.compat.v1.executing_eagerly_outside_functions():
            # Made where the state variables are (same strategy scope).
            self.variable = tf.Variable(
                tf.zeros([_SIZE], tf.int64), name="xla_step_record",
                trainable=False, aggregation=tf.VariableAggregation.NONE)
        self._watches = []
        self._lock = threading.Lock()
        # `refusal_message(values)`: the message of a REFUSED record, from
        # the values `refuse` was given; set by the refusing caller.
        self.refusal_message = None

    def __deepcopy__(self, memo):
        # A copy of a loss scale has state of its own: its record starts
        # empty and nothing watches it yet (a lock cannot be copied anyway).
        del memo
        return StepRecord(self.fields, self.floor, self.hysteresis,
                          self.policy, self.limit)

    # Watches: objects with `live()` and `traced`, added by the host.

    def add_watch(self, watch):
        with self._lock:
            self._watches.append(watch)

    def remove_watch(self, watch):
        with self._lock:
            self._watches = [w for w in self._watches if w is not watch]

    def check_watched(self):
        """At trace time: a configuration that needs the host needs a live
        watch, whose `traced` is set; dead watches are dropped."""
        with self._lock:
            self._watches = [w for w in self._watches if w.live()]
            live = list(self._watches)
        if not self.needs_host:
            return
        if not live:
            raise RuntimeError(failure_policy.NOT_WATCHED.format(
                asks=failure_policy.what_is_asked(self.policy, self.limit)))
        for watch in live:
            watch.traced = True

    # Device side, traced into the XLA step.

    def update(self, state, all_finite, valid, next_state, assign):
        """The scale's update under XLA; returns `(update_op, should_apply)`.

        Args:
          state: the `DynamicState` read this step.
          all_finite: the all-replica finiteness flag.
          valid: a bool tensor, whether `state` passes the state check.
          next_state: `next_state(state, all_finite) -> (new, at_floor)`.
          assign: `assign(new_state) -> assignment ops`.

        Raises:
          RuntimeError: the policy needs the host and no watch is live, or
            the loss scale was made in a TF1 graph.
        """
        if self.variable is None:
            raise RuntimeError(
                "tf_lossscale: a DynamicLossScale made in a TF1 graph cannot "
                "run in an XLA-compiled step; compile the step without XLA.")
        self.check_watched()
        # A step after a failure, or on a state that cannot be right, changes
        # nothing: the host has not raised yet. A refusal keeps the bad state.
        refused, proceed = self.refuse(tf.logical_not(valid), _values(state),
                                       INVALID)
        new_state, at_floor = next_state(state, all_finite)
        kept = type(state)(*(
            None if old is None else tf.where(proceed, new, old)
            for old, new in zip(state, new_state)))
        with tf.control_dependencies([refused]):
            assignments = assign(kept)
            record = tf.convert_to_tensor(self.variable)
        at_floor = tf.logical_and(proceed, at_floor)
        skips = kept.consecutive_skips
        if skips is None:  # Only "continue" without a limit lacks C.
            skips = tf.zeros([], tf.int64)
        code = tf.constant(NONE, tf.int64)
        if self.limit is not None:
            code = tf.where(tf.logical_and(proceed, skips >= self.limit),
                            tf.constant(TOO_MANY_SKIPS, tf.int64), code)
        if self.policy == "raise":  # Wins over the limit, as without XLA.
            code = tf.where(at_floor, tf.constant(AT_FLOOR, tf.int64), code)
        # A new failure records the values after the step; an earlier one, or
        # a refusal, keeps its own.
        failed = tf.not_equal(code, NONE)
        head = tf.where(failed, tf.stack([code, *_values(kept)]),
                        record[:_WARNINGS])
        warns = at_floor if self.policy == "warn" else tf.constant(False)
        warning = tf.where(
            warns, tf.stack([record[_WARNINGS] + 1, _bits(kept.scale), skips]),
            record[_WARNINGS:])
        with tf.control_dependencies(assignments):
            written = self.variable.assign(tf.concat([head, warning], axis=0))
        with tf.control_dependencies(assignments + [written]):
            should_apply = tf.logical_and(
                tf.logical_and(all_finite, proceed), tf.logical_not(failed))
        return tf.group(assignments + [refused, written]), should_apply

    def refuse(self, refused, values, code=REFUSED):
        """Records, under XLA, a step refused before the loss scale moves:
        `refused` (a bool tensor) writes `code` (REFUSED: by the caller, for
        `refusal_message`) and `values` (up to four int tensors) unless a
        failure is recorded already. Returns `(op, proceed)`: proceed is
        False when the step is refused now or halted by an earlier failure."""
        self.traced = True
        record = tf.convert_to_tensor(self.variable)
        clear = tf.equal(record[_CODE], NONE)
        values = [tf.cast(value, tf.int64) for value in values]
        values += [tf.zeros([], tf.int64)] * (_SKIPS - _CODE - len(values))
        refused_record = tf.concat(
            [tf.constant([code], tf.int64), tf.stack(values),
             record[_WARNINGS:]], axis=0)
        written = self.variable.assign(tf.where(
            tf.logical_and(clear, refused), refused_record, record))
        return written, tf.logical_and(clear, tf.logical_not(refused))

    def halted(self):
        """Whether the step just updated must neither apply nor be recorded
        as skipped (it failed or was refused); read after the update."""
        return tf.not_equal(tf.convert_to_tensor(self.variable)[_CODE], NONE)

    # Host side: reading it back.

    def take(self):
        """Reads the record (one small device-to-host read) and clears it;
        None when it holds nothing. Eagerly, in cross-replica context."""
        values = self.variable.numpy()
        if not values.any():
            return None
        self.variable.assign(tf.zeros([_SIZE], tf.int64))
        state = {name: int(value) for name, value in zip(
            failure_policy.FIELDS, values[_SCALE:_SKIPS + 1])
                 if name in self.fields}
        state["current_loss_scale"] = _scale_from_bits(values[_SCALE])
        return Recorded(int(values[_CODE]), state,
                        tuple(int(v) for v in values[_SCALE:_SKIPS + 1]),
                        int(values[_WARNINGS]),
                        _scale_from_bits(values[_WARN_SCALE]),
                        int(values[_WARN_SKIPS]))


def _values(state):
    """S's bits, G, H, C of a `DynamicState` (0 for an untracked one)."""
    return [_bits(state.scale)] + [
        tf.cast(0 if value is None else value, tf.int64)
        for value in state[1:]]


def record_of(target):
    """The `StepRecord` of a loss scale or of an optimizer's loss scale;
    None for loss scales that have none (fixed, user-defined)."""
    return getattr(target, "_xla_record", None) or getattr(
        getattr(target, "loss_scale", None), "_xla_record", None)


def check_watched(loss_scale):
    """While tracing under XLA, raises the RuntimeError of `StepRecord.update`
    now if it would: for callers that create variables before the update (a
    trace that fails after creating variables leaves them unusable)."""
    record = record_of(loss_scale)
    if record is not None and in_xla_context():
        record.check_watched()

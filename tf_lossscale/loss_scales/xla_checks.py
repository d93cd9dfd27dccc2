"""The host side of the XLA checks: acting on what compiled steps recorded.

`act(target)` reads a loss scale's record (`xla_record`) and raises or warns
as the step would have without XLA, then clears it. It runs after each call
of a watched step (`with_xla_checks`, the `XlaChecks` and `LossScaleMonitor`
callbacks), at the end of Keras' `fit` (`finalize_variable_values`) and at
every eager read of the scale; each time it syncs one small read, and none
for a loss scale no XLA step of which has been traced. A `Watch` lets XLA
steps of a loss scale that asks for failures or warnings be traced.
"""

import functools
import sys

import tensorflow as tf

from tf_lossscale.loss_scales import failure_policy
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.ops import replicas


def act(target):
    """Raises or warns as the XLA steps of `target` (an optimizer or loss
    scale) recorded since the host last acted, then clears the record.

    Syncs device and host: one small read, only if an XLA step of this loss
    scale has been traced; nothing inside a `tf.function` or replica context.

    Raises:
      tf.errors.InvalidArgumentError: a step failed or was refused, with the
        message it would have raised without XLA.
    """
    record = xla_record.record_of(target)
    # Only eagerly and outside any replica context may it be read and cleared.
    if (record is None or not record.traced or not tf.executing_eagerly()
            or replicas.in_replica_context()):
        return
    recorded = record.take()
    if recorded is None:
        return
    if recorded.warnings:
        line = failure_policy.format_like_the_step(
            failure_policy.floor_template(record.floor, "warn"),
            ((recorded.warn_scale, tf.float32),
             (recorded.warn_skips, tf.int64)))
        if recorded.warnings > 1:
            line += (f" (the last of {recorded.warnings} such steps since the "
                     "host last checked)")
        print(line, file=sys.stderr, flush=True)
    if recorded.code != xla_record.NONE:
        raise tf.errors.InvalidArgumentError(
            None, None, _failure_message(record, recorded))


def _failure_message(record, recorded):
    state = recorded.state
    if recorded.code == xla_record.REFUSED:
        return record.refusal_message(recorded.values)
    if recorded.code == xla_record.INVALID:
        return failure_policy.invalid_state_message(state, record.hysteresis)
    scale = (state["current_loss_scale"], tf.float32)
    skips = (state.get("consecutive_skips", 0), tf.int64)
    if recorded.code == xla_record.AT_FLOOR:
        return failure_policy.format_like_the_step(
            failure_policy.floor_template(record.floor, record.policy),
            (scale, skips))
    return failure_policy.format_like_the_step(
        failure_policy.limit_template(record.limit), (skips, scale))


class Watch:
    """Lets XLA steps of `target`'s loss scale be traced while it is live.

    Live from `start()` to `end()`, and while `is_live()` (if given) holds:
    a callback passes what tells that the fit it watches still runs the
    function it began with. `traced` becomes True when a step of a loss
    scale that needs the host is traced under it: that compiled step may
    only run while someone acts after each call.

    Args:
      target: an optimizer or a loss scale.
      is_live: an optional callable, re-evaluated at each trace.
    """

    def __init__(self, target, is_live=None):
        self._record = xla_record.record_of(target)
        self._is_live = is_live
        self._started = False
        self.traced = False

    def start(self):
        if self._record is not None and not self._started:
            self._started = True
            self._record.add_watch(self)

    def end(self):
        if self._started:
            self._started = False
            self._record.remove_watch(self)

    def live(self):
        return self._started and (self._is_live is None or self._is_live())

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.end()


def with_xla_checks(step, target):
    """Returns `step` made to run the host-side checks after each call.

    For custom training loops (and `model.train_on_batch`) whose step is
    compiled with XLA and whose `DynamicLossScale` asks for failures or
    warnings (`on_min_loss_scale="warn"` or `"raise"`,
    `max_consecutive_skips`): such a step can only be traced inside the
    returned function, and each call is followed by the checks (one small
    read of the loss scale's record; none before any XLA trace). Harmless
    without XLA::

        train_step = tf_lossscale.with_xla_checks(
            tf.function(train_step, jit_compile=True), optimizer)

    Call the step through the returned function only: a call of the bare
    step is not followed by the checks (its failures halt training and are
    raised at the next checked call or read of the scale).

    Args:
      step: the callable that runs one or more training steps.
      target: the `tf_lossscale.LossScaleOptimizer` (or `LossScale`) it uses.
    """

    @functools.wraps(step)
    def checked_step(*args, **kwargs):
        with Watch(target):
            result = step(*args, **kwargs)
        act(target)
        return result

    return checked_step

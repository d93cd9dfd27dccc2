"""One loss-scaled optimizer step, the same for every optimizer wrapper.

The Keras 3, tf-keras and TF1 wrappers hand one step's gradients to
`apply_or_skip`: it sums them over every replica and worker with the
all-reduce the inner optimizer would make, reads the finiteness flag off the
sum (no collective of its own: docs/guides/distribution.md, "How the replicas
agree"), updates the loss scale from it, then applies the sums in every
replica or skips, writing a `SkipRecord`. In a `group.iteration()` block a
`LossScaleGroup`'s steps wait for its end (`DeferredStep.run_together`).
Under XLA a failed or refused step halts every later one until the host has
acted (`loss_scales.xla_checks`).
"""

import contextlib
import functools
from typing import Callable, NamedTuple

import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale import groups as group_lib
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.ops import finiteness
from tf_lossscale.ops import float16
from tf_lossscale.ops import replicas
from tf_lossscale.ops import unscaling


def scale_loss(loss, loss_scale):
    """`loss * loss_scale()` in the loss's dtype; for a callable `loss`, a
    callable that returns it. A loss that is not floating-point raises
    TypeError (`checks.loss`)."""
    if callable(loss):
        return lambda: scale_loss(loss(), loss_scale)
    loss = checks.loss(loss)
    return loss * tf.cast(loss_scale(), loss.dtype)


def unscale_for_apply(grads, variables, scale):
    """`grads / scale`, except for variables that take their gradient as
    their value; `None` and `tf.IndexedSlices` entries keep their form."""
    return unscaling.unscale(
        grads, scale,
        keep=[float16.takes_gradient_as_value(v) for v in variables])


class StepParts(NamedTuple):
    """The parts of a step that are plain functions: every wrapper runs
    `FULL_STEP`; the benchmark's ablations replace one part at a time.

    Attributes:
      unscale: `unscale(grads, variables, scale)`, run by the wrappers whose
        caller hands over scaled gradients (`unscale_for_apply`).
      check: `check(grads)`, one replica's gradients -> scalar bool, True
        when all are finite (`finiteness.all_finite`).
      agree: `agree(check, grads)`, cross-replica context -> the bool every
        replica agrees on (`replicas.from_summed`).
      each_any: `each_any(flags_fn, grads)`, the same context -> a bool
        vector, True where `flags_fn` is True on any replica.
    """
    unscale: Callable
    check: Callable
    agree: Callable
    each_any: Callable = replicas.from_summed


def summed_by_caller(parts):
    """`parts` for gradients a caller summed, which the step cannot know
    every replica holds alike: each replica checks its own and one scalar
    all-reduce agrees (the skip record's flags, one more in its branch)."""
    return parts._replace(agree=replicas.all_replicas_true,
                          each_any=replicas.any_replica_true)


FULL_STEP = StepParts(unscale=unscale_for_apply,
                      check=finiteness.all_finite,
                      agree=replicas.from_summed)


class SkipRecord(NamedTuple):
    """What a skipped step writes: one more skipped step, and a flag per
    variable (1 where its gradient, summed over the replicas, held NaN or
    +-Inf: where it did on any replica, or the sum overflowed)."""
    skipped_steps: object  # A scalar int64 variable.
    nonfinite_flags: object  # An int32 vector variable, a flag a position.
    # Maps the list of the step's variables to their positions in it.
    positions: Callable

    def write(self, grads, variables, each_any):
        """Cross-replica context: records one skipped step; `each_any` is
        the step's `StepParts.each_any`."""
        # Keras variables' assign methods take no `read_value`.
        ops = [self.skipped_steps.assign_add(1)]
        positions = self.positions(variables)
        size = self.nonfinite_flags.shape[0]

        def local_flags(local_grads):
            # True at positions[i] when gradient i is not finite.
            flags = finiteness.nonfinite_flags(list(local_grads))
            if list(positions) == list(range(size)):
                return flags
            if not positions:
                return tf.zeros([size], tf.bool)
            return tf.tensor_scatter_nd_max(
                tf.zeros([size], tf.int32), [[p] for p in positions],
                tf.cast(flags, tf.int32)) > 0

        flags = each_any(local_flags, grads)
        return ops + [self.nonfinite_flags.assign(tf.cast(flags, tf.int32))]


@contextlib.contextmanager
def building_outside_traces():
    """For a wrapper's first build, which may come inside a traced step:
    its variables are made eagerly and are not the tf.function's (which may
    create variables on its first call only, and that trace may fail:
    `check_traceable`)."""

    def not_lifted(next_creator, **kwargs):
        kwargs["experimental_enable_variable_lifting"] = False
        return next_creator(**kwargs)

    with tf.init_scope(), tf.variable_creator_scope(not_lifted):
        yield


# Call first in an apply, before anything is built: under XLA, a loss scale
# whose failures need a watcher and has none fails the trace here, before
# variables are created in it.
check_traceable = xla_record.check_watched


def update_loss_scale(loss_scale, grads, parts):
    """Cross-replica context: updates `loss_scale` from `grads` (unscaled,
    possibly per-replica) and returns `(update_op, should_apply)`.

    The built-in loss scales are driven by the all-replica flag that the
    `StepParts` `parts` check and agree on, `should_apply` ordered after
    their state check, update and policy; a fixed scale that never skips
    computes no check at all.
    """
    update_from_flag = getattr(loss_scale, "_update_from_all_finite", None)
    if update_from_flag is None:
        return loss_scale.update(grads)  # A user-defined LossScale.
    if not getattr(loss_scale, "_needs_finiteness", True):
        return update_from_flag(tf.constant(True))
    return update_from_flag(parts.agree(parts.check, grads))


def apply_or_skip(loss_scale, grads, variables, apply_fn, skip_record,
                  stats=None, parts=None, summed=False):
    """One step: sum, update the scale, then apply in every replica or skip.

    Called in a replica context (inside `strategy.run`, `fit`'s train step)
    or without a strategy; all replicas take the same branch.

    Args:
      loss_scale: the `tf_lossscale.LossScale`.
      grads: the step's *unscaled* gradients, a list.
      variables: the list of variables `grads` belong to.
      apply_fn: `apply_fn(grads, variables)` applies gradients already
        summed over the replicas, without summing them again; it is called
        once in every replica with that replica's copy of the sums, and may
        return an op or tensor to wait on.
      skip_record: the `SkipRecord` written on skipped steps, or None to
        record nothing (a wrapper whose checkpoints hold no such state).
      stats: None, or the opted-in per-step gradient statistics of
        `tf_lossscale.monitor.gradient_stats`, written on every step from
        the gradients and the scale they ran with: each replica's
        `stats.measure` rides the gradients' all-reduce, and `stats.write`
        records the sum.
      parts: the `StepParts` to run; None for `FULL_STEP`.
      summed: True when every replica already holds the same `grads` (a
        wrapper's inner optimizer summed them): no all-reduce at all.

    Returns:
      None eagerly; in graphs an op that runs the whole step (TF1 callers
      run it; in `tf.function` the step runs anyway).
    """
    # Before the update, which waits for them: the statistics are of the
    # scale the step ran with, and of each replica's own gradients.
    measured = [] if stats is None else [stats.measure(grads, loss_scale)]
    if not summed:
        summed_all = replicas.sum_gradients(list(grads) + measured)
        grads, measured = (summed_all[:len(grads)],
                           summed_all[len(grads):])
    # Only the data crosses `merge_call`: anything passed through it comes
    # back regrouped per replica, callables included.
    return replicas.call_in_cross_replica_context(
        functools.partial(_cross_replica_step, loss_scale, apply_fn,
                          skip_record, stats, parts or FULL_STEP), grads,
        variables, measured)


def _cross_replica_step(loss_scale, apply_fn, skip_record, stats, parts,
                        grads, variables, measured):
    if stats is not None:
        stats = functools.partial(stats.write, measured[0])
    step = DeferredStep(loss_scale, apply_fn, skip_record, stats, parts,
                        grads, variables)
    if isinstance(loss_scale, group_lib.GroupMember):
        block = loss_scale.group.deferring_block()
        if block is not None:
            loss_scale.group.defer(block, loss_scale, step)
            return _done([])
    with _after_stats([step]):
        update_op, should_apply = update_loss_scale(loss_scale, grads, parts)
    return _grouped(update_op, step.apply_or_skip(should_apply))


class DeferredStep(NamedTuple):
    """An optimizer's step in cross-replica context, as `apply_or_skip` was
    given it; in a `group.iteration()` block, waiting for its end."""
    member: object  # The optimizer's loss scale (in a group, its member).
    apply_fn: Callable
    skip_record: object
    stats: Callable  # Records the step's gradient statistics, or None.
    parts: StepParts
    grads: list
    variables: list

    @classmethod
    def run_together(cls, group, steps):
        """Cross-replica context: the block's `steps` as one iteration: each
        step's finiteness flag, read off its summed gradients, the group's
        step from them, then each step applies or skips."""
        with _after_stats(steps):
            if steps[0].member._needs_finiteness:  # pylint: disable=protected-access
                # Gradients a caller summed need agreeing (`summed_by_caller`).
                decide = (replicas.from_summed if all(
                    step.parts.agree is replicas.from_summed
                    for step in steps) else replicas.all_replicas_true)
                agreed = decide(
                    lambda *grads: tf.stack([
                        step.parts.check(g) for step, g in zip(steps, grads)]),
                    *[step.grads for step in steps])
                flags = tf.unstack(agreed, num=len(steps))
            else:
                flags = [tf.constant(True)] * len(steps)
            update_op, should_apply = group.step(
                [step.member for step in steps], flags, ends_now=True)
        return _grouped(update_op, *[
            step.apply_or_skip(should)
            for step, should in zip(steps, should_apply)])

    def apply_or_skip(self, should_apply):
        """Cross-replica context: applies in every replica if `should_apply`,
        else writes the skip record; returns what to wait on (None eagerly).
        """

        def apply_in_every_replica():
            results = replicas.call_for_each_replica(
                self.apply_fn, self.grads, self.variables)
            # Per-replica results are unwrapped, so a TF1 graph's step op
            # waits on every replica's apply.
            return _done(replicas.local_results(results))

        def skip():
            if self.skip_record is None:
                return _done([])
            return _done(self.skip_record.write(
                self.grads, self.variables, self.parts.each_any))

        # Under XLA a step that failed (or was refused) changes nothing more,
        # as the error would have stopped it without XLA; the host raises
        # after the call, or later (tf_lossscale.loss_scales.xla_checks).
        record = xla_record.record_of(self.member)
        halted = (record.halted() if record is not None
                  and xla_record.in_xla_context() else None)
        if halted is not None:  # None: a record that halts nothing.
            skip = functools.partial(tf.cond, halted, lambda: _done([]), skip)
        if isinstance(should_apply, bool):
            return apply_in_every_replica() if should_apply else skip()
        return tf.cond(should_apply, apply_in_every_replica, skip)


def _after_stats(steps):
    """A scope whose ops run after the `steps`' statistics are written."""
    ops = [step.stats() for step in steps if step.stats is not None]
    return tf.control_dependencies([op for op in ops if op is not None])


def _grouped(*ops):
    """None eagerly; in graphs one op that runs `ops` (None ones left out)."""
    if tf.executing_eagerly():
        return None
    return tf.group([op for op in ops if op is not None])


def _done(ops):
    """A bool tensor that is ready once `ops` have run (graphs), so both
    branches of a `tf.cond` return the same structure; None eagerly."""
    if tf.executing_eagerly():
        return None
    waits = [op for op in ops
             if isinstance(op, (tf.Operation, tf.Tensor, tf.Variable))]
    with tf.control_dependencies(waits):
        return tf.constant(True)

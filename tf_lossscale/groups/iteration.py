"""The iteration rule of a `LossScaleGroup`: a pure function of tensors.

The open iteration is two int64 variables: the members that have stepped in
it (bit i for member i) and whether any of them had non-finite gradients. A
step of members M, each with its agreed finiteness flag f:

* it is refused, changing nothing, if a member of M has stepped already in
  the open iteration (the scale would count it twice) or the state cannot be
  right (loaded damaged);
* stepped |= M; overflowed |= not all(f);
* the iteration ends when every member has stepped, or at the end of a
  `group.iteration()` block: the loss scale takes one step, finite iff no
  gradient of the iteration overflowed, and both variables go back to 0.
"""

from typing import NamedTuple

import tensorflow as tf

from tf_lossscale.loss_scales import failure_policy

# The names of the iteration's state in checkpoints and `.keras` files.
STEPPED, OVERFLOWED = "iteration_members_stepped", "iteration_overflowed"


class IterationStep(NamedTuple):
    """What a step of some members does to the open iteration (tensors)."""
    refused: tf.Tensor  # bool: a member stepped twice, or the state is bad.
    repeated: tf.Tensor  # bool: a member of this step stepped already.
    ends: tf.Tensor  # bool: the iteration ends with this step.
    finite: tf.Tensor  # bool: no gradient of the iteration overflowed.
    stepped: tf.Tensor  # int64: the next `stepped`.
    overflowed: tf.Tensor  # int64: the next `overflowed`.


def next_iteration(stepped, overflowed, bits, all_finite, members, ends_now):
    """One step of the members `bits` on the iteration.

    Args:
      stepped, overflowed: the open iteration (int64 scalar tensors).
      bits: int, the bits of the members stepping now.
      all_finite: scalar bool tensor, their gradients' agreed flag.
      members: int, the bits of every member.
      ends_now: bool, whether the iteration ends with this step whatever
        has stepped (the end of a `group.iteration()` block).

    Returns:
      An `IterationStep`.
    """
    bits = tf.constant(bits, tf.int64)
    members = tf.constant(members, tf.int64)
    valid = tf.logical_and(
        tf.logical_and(stepped >= 0, tf.equal(
            tf.bitwise.bitwise_and(stepped, tf.bitwise.invert(members)), 0)),
        tf.logical_or(tf.equal(overflowed, 0), tf.equal(overflowed, 1)))
    repeated = tf.not_equal(tf.bitwise.bitwise_and(stepped, bits), 0)
    now_stepped = tf.bitwise.bitwise_or(stepped, bits)
    now_overflowed = tf.logical_or(tf.equal(overflowed, 1),
                                   tf.logical_not(all_finite))
    ends = tf.logical_or(tf.constant(ends_now), tf.equal(now_stepped, members))
    zero = tf.zeros([], tf.int64)
    return IterationStep(
        refused=tf.logical_or(repeated, tf.logical_not(valid)),
        repeated=repeated, ends=ends,
        finite=tf.logical_not(now_overflowed),
        stepped=tf.where(ends, zero, now_stepped),
        overflowed=tf.where(ends, zero, tf.cast(now_overflowed, tf.int64)))


def refusal_templates(bits, members):
    """The messages of a refused step of the members `bits`, with `{}` for
    the values (`tf.strings.format`): (a repeated step: stepped; a damaged
    state: stepped, overflowed). `members`: `(name, bit)` of each member."""
    names = ", ".join(name for name, bit in members if bits & bit)
    listed = ", ".join(f"{name} (bit {bit})" for name, bit in members)
    repeated = (
        f"tf_lossscale: {names} stepped twice in one iteration of its "
        f"LossScaleGroup, whose optimizers are {listed}; the bits of those "
        "that stepped in this iteration: {}. An iteration ends when every "
        "optimizer has stepped once: is one of them never used, or used "
        "in other iterations only? For schedules where the optimizers do "
        "not all step every iteration, make each iteration's steps inside "
        "`with group.iteration():`. The step was refused; nothing was "
        "changed.")
    invalid = (
        f"tf_lossscale: the LossScaleGroup of {names} holds a state that "
        f"cannot be right (restored from a file, or assigned?): "
        f"{STEPPED}={{}} (its optimizers: {listed}), {OVERFLOWED}={{}} "
        "(0 or 1). The step was refused; nothing was changed.")
    return repeated, invalid


def refusal_message(members, bits, stepped, overflowed):
    """The message of a refused step, formatted on the host as the step
    formats it (for one recorded under XLA)."""
    repeated, invalid = refusal_templates(bits, members)
    if stepped & bits:
        return failure_policy.format_like_the_step(
            repeated, ((stepped, tf.int64),))
    return failure_policy.format_like_the_step(
        invalid, ((stepped, tf.int64), (overflowed, tf.int64)))

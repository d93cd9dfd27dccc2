"""The rule that moves the factors of per-layer gradient scaling.

A scaled model is cut into segments, numbered from its inputs to its output;
the last, the top, is scaled by the loss scale S alone, every segment k below
it by S * F_k, so each segment's gradients can sit where float16 holds them.
`next_factor_state` is one step of the rule. With `min_factor ==
max_factor == 1` every F_k stays 1 and S's flag is the step's all-finite
flag: the single-scale rule, bit for bit. The rule, and why statistics and a
margin: docs/guides/per-layer-scaling.md.
"""

from typing import NamedTuple, Optional

import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale.loss_scales import dynamic_rule

# The margin's floor: below it a segment is scaled less than the whole of
# float16's range (2**-24 to 2**16) below its alignment.
MIN_MARGIN = 2.0 ** -24
_MAX_MARGIN = 1.0
# A segment without figures (its gradients all 0) climbs this much a step.
_CLIMB = 2.0 ** 8


class FactorRule(NamedTuple):
    """The checked arguments of the factor rule."""
    increment_period: int = 2000
    min_factor: float = 2.0 ** -40
    max_factor: float = 2.0 ** 40

    def margin_rule(self):
        return dynamic_rule.DynamicRule(
            increment_period=self.increment_period, multiplier=2.0,
            min_loss_scale=MIN_MARGIN, max_loss_scale=_MAX_MARGIN)

    def get_config(self):
        return dict(self._asdict())


def checked_rule(increment_period=2000, min_factor=2.0 ** -40,
                 max_factor=2.0 ** 40):
    """A `FactorRule` from user arguments.

    Raises:
      TypeError, ValueError: naming the argument and the value.
    """
    period = checks.positive_int("increment_period", increment_period)
    low = checks.finite_float32("min_factor", min_factor, above=0)
    high = checks.finite_float32("max_factor", max_factor, above=0)
    if high < low:
        raise ValueError(
            f"max_factor must be >= min_factor, got max_factor={max_factor!r}"
            f" and min_factor={min_factor!r}")
    return FactorRule(period, low, high)


class FactorState(NamedTuple):
    """Vectors over the lower segments: F (float32), M (float32), G (int64)."""
    factors: tf.Tensor
    margins: tf.Tensor
    good_steps: tf.Tensor


class Figures(NamedTuple):
    """What the replicas agreed on for one step.

    nonfinite: bool vector over every segment (the top last): its gradients
      held NaN or Inf on some replica.
    informed: bool vector over the lower segments: some replica measured
      both the segment's largest gradient and the top's as > 0.
    top_measured: bool scalar: some replica measured the top's as > 0.
    log2_ratio: float32 vector over the lower segments: log2(u_top / u_k),
      averaged over the informed replicas (0 where none was).
    all_finite: bool scalar, no element of `nonfinite` True (None: computed
      from it).
    """
    nonfinite: tf.Tensor
    informed: tf.Tensor
    top_measured: tf.Tensor
    log2_ratio: tf.Tensor
    all_finite: Optional[tf.Tensor] = None


def next_factor_state(state, figures, rule):
    """One step of the factor rule as a pure function of tensors, without
    branches (the same code eagerly, in graphs and under XLA). The rule, step
    by step (blame, margins, alignment, factors, S's flag):
    docs/guides/per-layer-scaling.md, "The rule, exactly".

    Args:
      state: the `FactorState` read this step: per lower segment, the factor
        F (float32), its margin M in [2**-24, 1] (float32) and good steps G
        (int64).
      figures: the step's `Figures`, what every replica and worker agreed on.
      rule: a `FactorRule`.

    Returns:
      `(new_state, top_finite)`: the next `FactorState`, and the flag the
      loss scale S is updated with (a bool scalar).
    """
    lower = state.factors.shape[0]
    one = tf.constant(1.0)
    flags = tf.cast(figures.nonfinite, tf.float32)
    # Per segment: 2 * (non-finite segments above it) + its own flag. Blame
    # goes to the one at 1; those at 0 or 1 learned something.
    above = tf.math.cumsum(flags, exclusive=True, reverse=True)
    code, _ = tf.split(above + above + flags, [lower, 1])
    blamed = tf.equal(code, one)
    known = code <= one
    all_finite = figures.all_finite
    if all_finite is None:
        all_finite = tf.logical_not(tf.reduce_any(figures.nonfinite))

    # Where known, a segment is finite unless blamed; elsewhere the move is
    # discarded.
    moved, at_floor = dynamic_rule.next_dynamic_state(
        dynamic_rule.DynamicState(state.margins, state.good_steps),
        tf.logical_not(blamed), rule.margin_rule())
    # S backs off for the top, and for a blamed segment whose own scale
    # cannot: its margin was at its floor, or its factor is; or it is not
    # scaled above the top (F <= 1): S itself is too high for it, and the
    # next batches would find the same of every segment, one at a time.
    stuck = tf.logical_and(blamed, tf.logical_or(
        at_floor, state.factors <= max(rule.min_factor, 1.0)))
    learned = tf.logical_and(known, tf.logical_not(stuck))
    margins = tf.where(learned, moved.scale, state.margins)
    good_steps = tf.where(learned, moved.good_steps, state.good_steps)

    alignment = state.factors / state.margins
    climbed = tf.where(figures.top_measured, alignment * _CLIMB, alignment)
    aligned = tf.where(figures.informed,
                       tf.pow(2.0, tf.floor(figures.log2_ratio)), climbed)
    alignment = tf.where(all_finite, aligned, alignment)
    factors = tf.clip_by_value(alignment * margins, rule.min_factor,
                               rule.max_factor)

    # S's flag: finite, or a lower segment took the blame itself (at most
    # one segment is blamed: when it is the top, no lower one is).
    top_finite = tf.logical_or(all_finite, tf.reduce_any(
        tf.logical_and(blamed, learned)))
    return FactorState(factors, margins, good_steps), top_finite

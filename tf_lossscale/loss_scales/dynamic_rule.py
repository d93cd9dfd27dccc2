"""The dynamic rule of `DynamicLossScale`: parameters, state, one step.

State: the scale S (float32), good steps G (int64) and, when a feature needs
them, the hysteresis budget H and the consecutive skips C (int64). One step:

* finite: C = 0; H = hysteresis if `consecutive_hysteresis`. If G + 1 >=
  increment_period: S = min(S * multiplier, max_loss_scale) if S * multiplier
  is finite in float32 (else S stays), G = 0, H = hysteresis; else G += 1.
* not finite (NaN or +-Inf; the step is skipped): G = 0, C += 1,
  H = max(H - 1, 0); when H reaches 0 a back-off is due:
  S = max(S * backoff_factor, min_loss_scale) (or S / multiplier without a
  `backoff_factor`). A back-off due with S already at the floor goes to
  `on_min_loss_scale` ("continue", "warn" or "raise"); then the step fails
  if C >= max_consecutive_skips.

Without H (hysteresis=1) every non-finite step backs off. With its default
arguments this is TensorFlow's `tf.compat.v1.mixed_precision.
DynamicLossScale`, float32 arithmetic in the same order: bit-identical scales,
the same variables and the same three config keys.
"""

from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_lossscale.loss_scales import failure_policy
from tf_lossscale._internal import checks


class _DefaultFloor(float):
    """The type of `min_loss_scale`'s default: 1.0, but told from an explicit 1.0.

    Only an explicit floor above `initial_loss_scale` is an error; with the
    default one, an initial scale below 1 keeps TensorFlow's behaviour.
    """

    __slots__ = ()


DEFAULT_MIN_LOSS_SCALE = _DefaultFloor(1.0)


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
    counted = good_steps + 1
    period_reached = counted >= rule.increment_period
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
        counted, tf.zeros_like(good_steps))
    skips = state.consecutive_skips
    new_skips = None if skips is None else tf.where(
        is_finite, tf.zeros_like(skips), skips + 1)
    at_floor = tf.logical_and(backoff_due, scale <= floor)
    return DynamicState(new_scale, new_good_steps, new_budget,
                        new_skips), at_floor


def _check_bounds(initial, floor, floor_is_explicit, ceiling):
    """The cross-argument checks, on the float32 values the state will hold."""
    if floor_is_explicit and np.float32(floor) > np.float32(initial):
        raise ValueError(
            f"min_loss_scale must be <= initial_loss_scale, got "
            f"min_loss_scale={floor!r} and initial_loss_scale={initial!r}")
    if ceiling is None:
        return
    if np.float32(ceiling) < np.float32(initial):
        raise ValueError(
            f"max_loss_scale must be >= initial_loss_scale, got "
            f"max_loss_scale={ceiling!r} and initial_loss_scale={initial!r}")
    if np.float32(ceiling) < np.float32(floor):
        which = "" if floor_is_explicit else " (its default)"
        raise ValueError(
            f"max_loss_scale must be >= min_loss_scale, got "
            f"max_loss_scale={ceiling!r} and min_loss_scale={floor!r}{which}")


class DynamicArguments(NamedTuple):
    """`DynamicLossScale`'s constructor arguments, checked."""
    initial_loss_scale: float
    rule: DynamicRule
    on_min_loss_scale: str = "continue"
    max_consecutive_skips: Optional[int] = None


def checked_arguments(initial_loss_scale, increment_period, multiplier,
                      backoff_factor, min_loss_scale, max_loss_scale,
                      hysteresis, consecutive_hysteresis, on_min_loss_scale,
                      max_consecutive_skips):
    """`DynamicArguments` from `DynamicLossScale`'s arguments.

    Raises:
      TypeError, ValueError: as `DynamicLossScale` documents, naming the
        argument and the value.
    """
    initial = checks.finite_float32(
        "initial_loss_scale", initial_loss_scale, above=0)
    period = checks.positive_int("increment_period", increment_period)
    factor = checks.finite_float32("multiplier", multiplier, above=1)
    if backoff_factor is not None:
        backoff_factor = checks.finite_float32(
            "backoff_factor", backoff_factor, above=0, below=1)
    floor_is_explicit = min_loss_scale is not DEFAULT_MIN_LOSS_SCALE
    floor = checks.finite_float32(
        "min_loss_scale", min_loss_scale, above=0)
    if max_loss_scale is not None:
        max_loss_scale = checks.finite_float32(
            "max_loss_scale", max_loss_scale, above=0)
    _check_bounds(initial, floor, floor_is_explicit, max_loss_scale)
    budget = checks.positive_int("hysteresis", hysteresis)
    consecutive = checks.boolean(
        "consecutive_hysteresis", consecutive_hysteresis)
    policy = checks.one_of(
        "on_min_loss_scale", on_min_loss_scale, failure_policy.POLICIES)
    skip_limit = checks.optional_positive_int(
        "max_consecutive_skips", max_consecutive_skips)
    rule = DynamicRule(period, factor, backoff_factor, floor, max_loss_scale,
                       budget, consecutive)
    return DynamicArguments(initial, rule, policy, skip_limit)


def config_of(arguments):
    """`DynamicLossScale.get_config()` of `arguments`: TensorFlow's three
    keys, then the others that differ from their defaults (so a default
    config is TensorFlow's)."""
    values = {"initial_loss_scale": arguments.initial_loss_scale,
              **arguments.rule._asdict(),
              **arguments._asdict()}
    defaults = {**DynamicRule._field_defaults,
                **DynamicArguments._field_defaults}
    return {name: value for name, value in values.items()
            if name != "rule"
            and (name not in defaults or value != defaults[name])}

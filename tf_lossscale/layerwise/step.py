"""A loss-scaled step over segments: what a `LossScaleOptimizer` runs once a
`LayerwiseModel` is compiled with it.

`SegmentedStep.step` replaces three things of `loss_scaled_step`'s: the
`StepParts` (unscale each gradient by its segment's S * F; the per-segment
figures of the summed gradients), the loss scale (S and the factors, moved by
`rule.next_factor_state`) and the opted-in gradient statistics (each gradient
at its own scale). The skip, its record and S's policies stay the core's.
"""

import math
from typing import NamedTuple

import tensorflow as tf

from tf_lossscale.layerwise import rule as rule_lib
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.ops import finiteness
from tf_lossscale.ops import replicas
from tf_lossscale.step import loss_scaled_step

_LN2 = math.log(2.0)  # float32 rounds it as it does tf.math.log(2.0).


class SegmentedStep:
    """The per-step plan of a model's segments.

    Args:
      state: the model's `FactorState` of variables (`factors`, `margins`,
        `good_steps`).
      rule: the `FactorRule`.
      segment_of: `{id(variable): segment}` for the model's trainable
        variables; any other variable counts as the top's.
      names: each segment's name (its first layer's), the top's last.
    """

    def __init__(self, state, rule, segment_of, names):
        self._state = state
        self._rule = rule
        self._segment_of = segment_of
        self.names = list(names)
        self.top = len(names) - 1

    def segments(self, variables):
        """The segment of each of `variables`."""
        return [self._segment_of.get(id(v), self.top) for v in variables]

    def factor_values(self):
        """`{segment name: F}` (the top's is 1); syncs device and host."""
        values = [float(f) for f in self._state.factors.numpy()] + [1.0]
        return dict(zip(self.names, values))

    def step(self, loss_scale, variables, parts, stats):
        """`(loss_scale, parts, stats)` for one step over `variables`: what
        `LossScaleOptimizer.apply` hands to the step core instead of its
        own."""
        segments = self.segments(variables)
        factors = tf.convert_to_tensor(self._state.factors)
        parts = loss_scaled_step.StepParts(
            unscale=lambda grads, variables, scale: _unscale(
                grads, variables, scale, segments, factors, self.top),
            check=lambda grads: _figures(grads, segments, self.top),
            agree=replicas.from_summed)
        if stats is not None:
            stats = _SegmentStats(stats, segments, factors, self.top)
        return _SegmentedUpdate(loss_scale, self._state, factors, self._rule,
                                self.top), parts, stats


def _unscale(grads, variables, scale, segments, factors, top):
    """`grads / (S * F)`, each by its segment's factor; Keras' float8
    variables keep their gradient as computed."""
    unscaled = list(grads)
    scale = tf.cast(scale, tf.float32)
    # Every lower segment's S * F in one multiply; the top's is S.
    divisors = tf.unstack(scale * factors, num=top) + [scale]
    for segment in dict.fromkeys(segments):  # In order of appearance.
        indices = [i for i, s in enumerate(segments) if s == segment]
        for index, grad in zip(indices, loss_scaled_step.unscale_for_apply(
                [grads[i] for i in indices], [variables[i] for i in indices],
                divisors[segment])):
            unscaled[index] = grad
    return unscaled


def _figures(grads, segments, top):
    """One replica's figures, a float32 vector of three rows with one
    element a segment (the top's last): 1 where its gradients hold NaN or
    Inf; 1 where informed (both its largest magnitude and the top's finite
    and > 0; the top's: whether its own is); log2(u_top / u_k) where
    informed, else 0.

    From one vector of every gradient's largest magnitude (+inf where the
    gradient is not finite), reduced per segment in one segment maximum.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    largest, order = finiteness.largest_magnitudes(
        [finiteness.dense_values(grads[i]) for i in present],
        xla=xla_record.in_xla_context())
    ids = [segments[present[i]] for i in order]
    zero, inf = tf.constant(0.0), tf.constant(float("inf"))
    # An empty segment's maximum is the lowest float: no figure, 0.
    per_segment = tf.maximum(tf.math.unsorted_segment_max(
        largest, tf.constant(ids, tf.int32), top + 1), zero)
    logs = tf.math.log(per_segment) / _LN2
    # Finite exactly where both maxima are finite and > 0. The rule reads
    # them on all-finite steps only.
    ratios = tf.unstack(logs, num=top + 1)[top] - logs
    informed = tf.math.is_finite(ratios)
    return tf.concat([
        tf.cast(tf.equal(per_segment, inf), tf.float32),
        tf.cast(informed, tf.float32), tf.where(informed, ratios, zero)],
                     axis=0)


def decode(figures, top):
    """The `rule.Figures` of `_figures`' vector, of the gradients summed
    over the replicas (every replica computes it alike)."""
    nonfinite, informed, top_measured, ratios, _ = tf.split(
        figures, [top + 1, top, 1, top, 1])
    zero = tf.constant(0.0)
    nonfinite = nonfinite > zero
    return rule_lib.Figures(
        nonfinite, informed > zero, top_measured > zero, ratios,
        tf.logical_not(tf.reduce_any(nonfinite)))


class _SegmentedUpdate:
    """What the step core updates for a step over segments: the loss scale
    S, from its flag, and the factors; it reads as S."""

    _needs_finiteness = True

    def __init__(self, loss_scale, state, factors, rule, top):
        self._loss_scale = loss_scale
        self._state = state
        self._factors = factors  # As read for the step's unscale.
        self._rule = rule
        self._top = top
        # The step core halts a failed XLA step by S's record.
        self._xla_record = xla_record.record_of(loss_scale)

    def __call__(self):
        return self._loss_scale()

    def _update_from_all_finite(self, figures):
        """Cross-replica context: `(update_op, should_apply)` from the
        figures of `_figures`."""
        figures = decode(figures, self._top)
        state = rule_lib.FactorState(
            self._factors, tf.convert_to_tensor(self._state.margins),
            tf.convert_to_tensor(self._state.good_steps))
        new_state, top_finite = rule_lib.next_factor_state(
            state, figures, self._rule)
        update_op, should_apply = self._loss_scale._update_from_all_finite(  # pylint: disable=protected-access
            top_finite)
        record = self._xla_record
        if record is not None and xla_record.in_xla_context():
            # A step S's failure policy stopped changes nothing more.
            halted = record.halted()
            new_state = rule_lib.FactorState(*(
                tf.where(halted, old, new)
                for old, new in zip(state, new_state)))
        assignments = [
            variable.assign(value)
            for variable, value in zip(self._state, new_state)]
        all_finite = figures.all_finite
        if tf.executing_eagerly():
            return None, bool(should_apply) and bool(all_finite)
        with tf.control_dependencies(assignments):
            should_apply = tf.logical_and(should_apply, all_finite)
        return tf.group([op for op in (update_op,) if op is not None]
                        + assignments), should_apply


class _SegmentStats(NamedTuple):
    """`LossScaleMonitor(gradient_stats=True)`'s statistics of a segmented
    step: each gradient measured at its own scale S * F."""
    selection: object  # The step's `gradient_stats` selection.
    segments: list
    factors: tf.Tensor
    top: int

    def measure(self, grads, loss_scale):
        """Replica context: `gradient_stats`' measure, each gradient at its
        own scale."""
        factors = tf.unstack(self.factors, num=self.top)
        return self.selection.measure(
            [g if g is None or s == self.top
             else g * tf.cast(factors[s], g.dtype)
             for g, s in zip(grads, self.segments)], loss_scale)

    def write(self, summed):
        return self.selection.write(summed)

"""A loss-scaled step over segments: what a `LossScaleOptimizer` runs once a
`LayerwiseModel` is compiled with it.

`SegmentedStep.step` gives the optimizer's apply three replacements for one
step: the `StepParts` (unscale each gradient by S * F of its segment; check
each segment's gradients; agree on the figures with one all-reduce), a loss
scale for the step core that updates S and the factors from them
(`rule.next_factor_state`), and the opted-in gradient statistics at each
gradient's own scale. Everything else is `loss_scaled_step`'s: the skip, its
record, S's failure policy and its XLA record.
"""

import collections

import tensorflow as tf

from tf_lossscale.layerwise import rule as rule_lib
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.ops import finiteness
from tf_lossscale.ops import replicas
from tf_lossscale.step import loss_scaled_step


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
        scales = _ScalesOf(factors, self.top)
        parts = loss_scaled_step.StepParts(
            unscale=lambda grads, variables, scale: _unscale(
                grads, variables, scale, segments, scales),
            check=lambda grads: _figures(grads, segments, self.top),
            agree=replicas.from_summed)
        if stats is not None:
            stats = _SegmentStats(stats, segments, scales)
        return _SegmentedUpdate(loss_scale, self._state, self._rule,
                                self.top), parts, stats


class _ScalesOf:
    """Each segment's factor, read once a step (None for the top's, 1)."""

    def __init__(self, factors, top):
        self._factors = tf.unstack(factors, num=top) if top else []

    def __call__(self, segment):
        return (self._factors[segment] if segment < len(self._factors)
                else None)


def _by_segment(segments):
    groups = collections.defaultdict(list)
    for index, segment in enumerate(segments):
        groups[segment].append(index)
    return groups


def _unscale(grads, variables, scale, segments, scales):
    """`grads / (S * F)`, each by its segment's factor; Keras' float8
    variables keep their gradient as computed."""
    unscaled = list(grads)
    scale = tf.cast(scale, tf.float32)
    for segment, indices in _by_segment(segments).items():
        factor = scales(segment)
        divisor = scale if factor is None else scale * factor
        for index, grad in zip(indices, loss_scaled_step.unscale_for_apply(
                [grads[i] for i in indices], [variables[i] for i in indices],
                divisor)):
            unscaled[index] = grad
    return unscaled


def _figures(grads, segments, top):
    """One replica's figures, a float32 vector: each segment's non-finite
    flag (the top's last); each lower segment's informed flag, then its
    log2(u_top / u_k) where informed; whether the top's largest is > 0.

    Per gradient one exact finiteness flag (`finiteness.nonfinite_flags`)
    and one largest magnitude (read only on finite steps: NaN need not win
    it), then one segment reduction of each.
    """
    present = [i for i, g in enumerate(grads) if g is not None]
    values = [tf.cast(finiteness.dense_values(grads[i]), tf.float32)
              for i in present]
    ids = tf.constant([segments[i] for i in present] or [top], tf.int32)
    flags = finiteness.nonfinite_flags(values) if values else tf.constant(
        [False])
    largest = tf.stack([tf.reduce_max(tf.abs(v)) for v in values]
                       or [tf.constant(0.0)])
    count = top + 1
    nonfinite = tf.math.unsorted_segment_max(
        tf.cast(flags, tf.float32), ids, count) > 0.0
    # An empty segment's maximum is the lowest float: no figure.
    largest = tf.maximum(tf.math.unsorted_segment_max(largest, ids, count),
                         0.0)
    lower, top_largest = largest[:top], largest[top]
    top_measured = tf.logical_and(
        tf.logical_not(tf.reduce_any(nonfinite)), top_largest > 0.0)
    informed = tf.logical_and(top_measured, lower > 0.0)
    log2 = lambda x: tf.math.log(x) / tf.math.log(2.0)  # pylint: disable=unnecessary-lambda-assignment
    ratios = log2(top_largest) - log2(tf.where(informed, lower, 1.0))
    return tf.concat([
        tf.cast(nonfinite, tf.float32), tf.cast(informed, tf.float32),
        tf.where(informed, ratios, 0.0),
        tf.cast(top_measured, tf.float32)[None]], axis=0)


def decode(summed, top):
    """The `rule.Figures` of `_figures`' vector (of the gradients summed
    over the replicas, which every replica computes alike)."""
    nonfinite = summed[:top + 1] > 0.0
    count = summed[top + 1:2 * top + 1]
    informed = count > 0.0
    log2_ratio = tf.where(informed, summed[2 * top + 1:3 * top + 1]
                          / tf.maximum(count, 1.0), 0.0)
    return rule_lib.Figures(nonfinite, informed, summed[-1] > 0.0, log2_ratio)


class _SegmentedUpdate:
    """What the step core updates for a step over segments: the loss scale
    S, from its flag, and the factors; it reads as S."""

    _needs_finiteness = True

    def __init__(self, loss_scale, state, rule, top):
        self._loss_scale = loss_scale
        self._state = state
        self._rule = rule
        self._top = top
        # The step core halts a failed XLA step by S's record.
        self._xla_record = xla_record.record_of(loss_scale)

    def __call__(self):
        return self._loss_scale()

    def _update_from_all_finite(self, summed):
        """Cross-replica context: `(update_op, should_apply)` from the
        summed figures."""
        figures = decode(summed, self._top)
        state = rule_lib.FactorState(*(
            tf.convert_to_tensor(v) for v in self._state))
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
        all_finite = tf.logical_not(tf.reduce_any(figures.nonfinite))
        if tf.executing_eagerly():
            return None, bool(should_apply) and bool(all_finite)
        with tf.control_dependencies(assignments):
            should_apply = tf.logical_and(should_apply, all_finite)
        return tf.group([op for op in (update_op,) if op is not None]
                        + assignments), should_apply


class _SegmentStats:
    """`LossScaleMonitor(gradient_stats=True)`'s statistics of a segmented
    step: each gradient measured at its own scale S * F."""

    def __init__(self, selection, segments, scales):
        self._selection = selection
        self._segments = segments
        self._scales = scales

    def write(self, grads, loss_scale):
        def at_own_scale(local_grads):
            return [g if g is None or self._scales(s) is None
                    else g * tf.cast(self._scales(s), g.dtype)
                    for g, s in zip(local_grads, self._segments)]

        return self._selection.write(
            replicas.call_for_each_replica(at_own_scale, grads), loss_scale)

"""tf_lossscale's Keras 3 step with exactly one feature taken away.

Each ablation is built on a seam the step really runs through, never on a
method it might stop calling, and `tests/tools/test_benchmark_ablations.py`
traces each one and checks that it holds fewer of the ops it claims to
remove than the full step. The difference in cost between the full step and an ablation
is what that feature costs (`sections.fit_step`, `sections.xla_fit`).

| feature | seam | what the ablation does instead |
|---|---|---|
| the finiteness check | `StepParts.check` | reads a flag that is always True |
| the unscale | `StepParts.unscale` | hands the scaled gradients on |
| the overflow record | `LossScaleOptimizer._skip_record` | records nothing |
| the state check and policies | `DynamicLossScale._step` | the rule alone: no check, no policy |
| the XLA record | `DynamicLossScale._xla_record` (`xla_record.StepRecord`) | the rule alone: no record, no halt |

The replica agreement has no ablation: it is the gradients' own all-reduce,
moved ahead of the decision, with no op of its own (`sections.collectives`
counts the collectives).

The ablated steps are wrong on purpose (they apply non-finite steps, scaled
gradients, ...): they exist to be timed.
"""

from typing import Callable, NamedTuple

import keras
import tensorflow as tf

import tf_lossscale
from lsbench import gradient_sets
from lsbench import op_counts
from tf_lossscale.loss_scales import dynamic_rule
from tf_lossscale.step import loss_scaled_step
from tf_lossscale.loss_scales import xla_record


def _no_unscale(grads, variables, scale):
    del variables, scale
    return list(grads)


class NoCheck(tf_lossscale.LossScaleOptimizer):

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A flag that costs one read and, unlike a constant, cannot be
        # folded away with the branch it decides. Set past Keras' attribute
        # tracking: not state of the optimizer.
        flag = tf.Variable(True, trainable=False, name="ablation_flag")
        object.__setattr__(self, "_step_parts",
                           loss_scaled_step.FULL_STEP._replace(
                               check=lambda grads: flag.read_value()))


class NoUnscale(tf_lossscale.LossScaleOptimizer):
    _step_parts = loss_scaled_step.FULL_STEP._replace(unscale=_no_unscale)


class NoOverflowRecord(tf_lossscale.LossScaleOptimizer):
    _skip_record = None  # In place of the wrapper's property.


class UncheckedDynamicLossScale(tf_lossscale.DynamicLossScale):
    """Outside XLA: the scale's step (`_step`, under the update's lock)
    without the state check and the failure policy: the rule moves the
    state, and `should_apply` waits for its assignments."""

    def _step(self, all_finite, gated):
        if xla_record.in_xla_context():
            return super()._step(all_finite, gated)
        state = dynamic_rule.DynamicState(*(
            None if variable is None else tf.convert_to_tensor(variable)
            for variable in self._state_variables_in_order()))
        new_state, _ = dynamic_rule.next_dynamic_state(
            state, all_finite, self._rule)
        assignments = self._assign_state(new_state)
        if tf.executing_eagerly():
            return None, all_finite
        with tf.control_dependencies(assignments):
            should_apply = tf.identity(all_finite)
        return tf.group(assignments), should_apply


class _RuleOnly(xla_record.StepRecord):
    """In place of the loss scale's `xla_record.StepRecord`: under XLA the
    rule alone moves the scale; no record is read or written, and no halt is
    read back (`halted` is None, so the step holds no branch on it)."""

    def update(self, state, all_finite, valid, next_state, assign):
        del valid
        self.check_watched()
        new_state, _ = next_state(state, all_finite)
        assignments = assign(new_state)
        with tf.control_dependencies(assignments):
            should_apply = tf.identity(all_finite)
        return tf.group(assignments), should_apply

    def halted(self):
        return None


class UnrecordedDynamicLossScale(tf_lossscale.DynamicLossScale):
    """Under XLA: the rule alone, without the record of refusals, failures
    and warnings, and without the halt read after the update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        record = self._xla_record
        self._xla_record = _RuleOnly(record.fields, record.floor,
                                     record.hysteresis, record.policy,
                                     record.limit)


def _with_loss_scale(loss_scale_class):
    def make(inner_optimizer, **config):
        return tf_lossscale.LossScaleOptimizer(
            inner_optimizer, loss_scale=loss_scale_class(**config))
    return make


def full(inner_optimizer, **config):
    """The full step: `tf_lossscale.LossScaleOptimizer` with a
    `DynamicLossScale(**config)`."""
    return tf_lossscale.LossScaleOptimizer(
        inner_optimizer, loss_scale=tf_lossscale.DynamicLossScale(**config))


def _wrapper(optimizer_class):
    def make(inner_optimizer, **config):
        return optimizer_class(
            inner_optimizer, loss_scale=tf_lossscale.DynamicLossScale(**config))
    return make


class Ablation(NamedTuple):
    """One feature taken away.

    Attributes:
      feature: what is taken away.
      make: `make(inner_optimizer, **loss_scale_config)` -> the optimizer.
      removes: op types of which the ablated step holds fewer than the full
        one (where `where` says), each an op the feature adds.
      where: "graph" (a `tf.function`) or "xla" (`jit_compile=True`).
    """
    feature: str
    make: Callable
    removes: tuple
    where: str = "graph"


ABLATIONS = (
    Ablation("the finiteness check", _wrapper(NoCheck),
             ("Sum", "IsFinite", "All", "StatelessIf")),
    Ablation("the unscale", _wrapper(NoUnscale), ("RealDiv",)),
    Ablation("the overflow record", _wrapper(NoOverflowRecord),
             ("IsFinite", "LogicalNot", "AssignVariableOp")),
    Ablation("the state check and policies",
             _with_loss_scale(UncheckedDynamicLossScale), ("Assert", "If")),
    Ablation("the XLA record", _with_loss_scale(UnrecordedDynamicLossScale),
             ("ConcatV2", "StridedSlice", "Bitcast", "AssignVariableOp", "If"),
             where="xla"),
)


def by_feature(feature):
    for ablation in ABLATIONS:
        if ablation.feature == feature:
            return ablation
    raise KeyError(feature)


def traced_ops(make, shapes, where="graph", **config):
    """The op types of the step of `make(SGD, **config)` over variables of
    `shapes`, traced as `where` says."""
    optimizer = make(keras.optimizers.SGD(1e-9), **config)
    variables = gradient_sets.variables(shapes)
    return op_counts.traced_apply(
        optimizer, gradient_sets.scaled_gradients(shapes), variables,
        jit_compile=where == "xla")


def ops_removed(ablation, shapes, **config):
    """`(ops of the full step, ops the ablation removes)`, in all."""
    full_ops = traced_ops(full, shapes, ablation.where, **config)
    ablated = traced_ops(ablation.make, shapes, ablation.where, **config)
    return sum(full_ops.values()), sum(full_ops.values()) - sum(
        ablated.values())

"""Carrying a run on: a model fixed by its diagnosis (`Float16Diagnosis.fix`)
whose optimizer continues the original's, with its slots, its iterations
and its loss scale's state, and, scaled per layer, its factors
(docs/guides/failure-watch.md).
"""

from tf_lossscale._internal import checks
from tf_lossscale.keras3 import loss_scale_optimizer
from tf_lossscale.layerwise import model as layerwise_model
from tf_lossscale.loss_scales import group as group_lib


def carry_on(report, model, scale=None, also=(), per_layer=False):
    """Returns `report.fix(model)` compiled with an optimizer that holds the
    state of `model`'s: the inner optimizer's variables (iterations, slots),
    the skipped steps and the loss scale's state, its config kept.

    A skipped step leaves weights and optimizer state as they were, so the
    new model starts from exactly the state that failed, less the layers
    that made it fail.

    Args:
      report: the `Float16Diagnosis` of `model` as it is now.
      model: a Keras 3 model compiled with a `tf_lossscale.LossScaleOptimizer`
        (scaled per layer or not; not in a `LossScaleGroup`).
      scale: None (keep the scale as it is), or the loss scale to continue
        at, a number > 0 (a failure leaves the scale backed off to its floor:
        where it had settled is the better start).
      also: more layers to compute in float32 (`report.fix`'s `also`).
      per_layer: `report.fix`'s: the fixed model scaled per layer (a model
        scaled per layer already keeps its segments); its factor state is
        carried on too (`carry_scaling_state`).

    Raises:
      TypeError: `model`'s optimizer is not a Keras 3
        `tf_lossscale.LossScaleOptimizer`.
      ValueError: its loss scale belongs to a `LossScaleGroup`, or a bad
        `scale`; what `report.fix` raises.
    """
    old = getattr(model, "optimizer", None)
    if not isinstance(old, loss_scale_optimizer.LossScaleOptimizer):
        raise TypeError(
            "carrying a run on needs a model compiled with a "
            f"tf_lossscale.LossScaleOptimizer, got {checks.summary(old)}")
    if isinstance(old.loss_scale, group_lib.GroupMember):
        raise ValueError(
            "carrying a run on is not supported for an optimizer in a "
            "LossScaleGroup: fix the model with report.fix(model) and move "
            "the group's state yourself")
    if scale is not None:
        scale = checks.finite_float32("scale", scale, above=0)
    loss_scale = old.loss_scale
    inner = old.inner_optimizer
    with model.distribute_strategy.scope():
        optimizer = loss_scale_optimizer.LossScaleOptimizer(
            type(inner).from_config(inner.get_config()),
            loss_scale=type(loss_scale).from_config(loss_scale.get_config()))
    fixed = report.fix(model, optimizer=optimizer, also=also,
                       per_layer=per_layer)
    # Made scaled per layer anew, the model has an optimizer of its own, of
    # the same configs: it takes the state.
    optimizer = fixed.optimizer
    with fixed.distribute_strategy.scope():
        optimizer.build(fixed.trainable_variables)
    sources, targets = list(old.variables), list(optimizer.variables)
    if len(sources) != len(targets) or any(
            tuple(s.shape) != tuple(t.shape)
            for s, t in zip(sources, targets)):
        raise ValueError(
            f"the optimizer of model {model.name!r} holds variables the fixed "
            "model's cannot take one for one: "
            f"{[tuple(v.shape) for v in sources]} against "
            f"{[tuple(v.shape) for v in targets]}")
    for source, target in zip(sources, targets):
        target.assign(source)
    if scale is not None and optimizer.loss_scale.variables:
        # The first state variable is the scale (the saved order).
        optimizer.loss_scale.variables[0].assign(scale)
    carry_scaling_state(model, fixed)
    return fixed


def carry_scaling_state(model, fixed):
    """Gives `fixed` the per-layer scaling state of `model` (factors,
    margins, good steps: `tf_lossscale.layerwise.LayerwiseModel`) when both
    are scaled per layer with the same segments; a model newly scaled per
    layer keeps its fresh state (its factors align within a few steps).

    Raises:
      ValueError: both are scaled per layer, with other segments.
    """
    if not (isinstance(model, layerwise_model.LayerwiseModel)
            and isinstance(fixed, layerwise_model.LayerwiseModel)):
        return
    if model.segments != fixed.segments:
        raise ValueError(
            f"the fixed model {fixed.name!r} is cut into segments "
            f"{fixed.segments}, not {model.segments} as model "
            f"{model.name!r}: its per-layer state cannot be carried on")
    # The fix's copy holds them already (they are among the model's
    # weights); assigned here so that no path to `fixed` can lose them.
    for source, target in zip(model.factor_state, fixed.factor_state):
        target.assign(source)

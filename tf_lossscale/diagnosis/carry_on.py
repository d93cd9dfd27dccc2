"""Carrying a run on: a model fixed by its diagnosis (`Float16Diagnosis.fix`)
whose optimizer continues the original's, with its slots, its iterations
and its loss scale's state; with a `LossScaleGroup`, every optimizer of the
group in a new group of the same state; scaled per layer, its factors
(docs/guides/failure-watch.md).
"""

from tf_lossscale._internal import checks
from tf_lossscale.keras3 import loss_scale_optimizer
from tf_lossscale.layerwise import model as layerwise_model
from tf_lossscale.step import optimizer_protocol
from tf_lossscale import groups as group_lib


def carry_on(report, model, scale=None, also=(), optimizers=None,
             per_layer=False):
    """Returns `report.fix(model)` compiled with an optimizer that holds the
    state of `model`'s: the inner optimizer's variables (iterations, slots),
    the skipped steps and the loss scale's state, its config kept
    (docs/guides/failure-watch.md). When `model`'s optimizer is in a
    `LossScaleGroup`, every optimizer of the group is carried on into a new
    group of the same config and state, each built for the fixed model's
    variables where the old one's were in `model`, and the return is
    `(fixed, [the new optimizers, in the order of optimizers])`.

    Args:
      report: the `Float16Diagnosis` of `model` as it is now.
      model: a Keras 3 or tf-keras model compiled with a
        `tf_lossscale.LossScaleOptimizer` (scaled per layer too, Keras 3:
        the fix keeps its segments, and their state is carried on).
      scale: None (keep the scale as it is), or the loss scale to continue
        at, a number > 0 (a failure leaves the scale backed off to its floor:
        where it had settled is the better start).
      also: more layers to compute in float32 (`report.fix`'s `also`).
      optimizers: with a group, every optimizer of it (`model.optimizer`
        among them), each built for variables of `model`; else None.
      per_layer: `report.fix`'s: the fixed model scaled per layer (a model
        scaled per layer already keeps its segments); its factor state is
        carried on too (`carry_scaling_state`).

    Raises:
      TypeError: `model`'s optimizer is not a
        `tf_lossscale.LossScaleOptimizer`.
      ValueError: its loss scale is in a `LossScaleGroup` and `optimizers`
        is not every optimizer of the group (or given without a group), or
        a bad `scale`; what `report.fix` raises.
    """
    old = getattr(model, "optimizer", None)
    if not isinstance(old, loss_scale_optimizer.LossScaleOptimizer):
        raise TypeError(
            "carrying a run on needs a model compiled with a "
            f"tf_lossscale.LossScaleOptimizer, got {checks.summary(old)}")
    group = (old.loss_scale.group
             if isinstance(old.loss_scale, group_lib.GroupMember) else None)
    olds = [old] if group is None else _group_optimizers(
        model, group, old, optimizers)
    if group is None and optimizers is not None:
        raise ValueError(
            "optimizers is for an optimizer in a LossScaleGroup, and "
            f"model.optimizer {old.name!r} is in none: got optimizers="
            f"{checks.summary(optimizers)}")
    if group is not None and per_layer and not isinstance(
            model, layerwise_model.LayerwiseModel):
        raise ValueError(
            f"per_layer=True would scale model {model.name!r} per layer anew "
            f"with an optimizer of its own, outside {group!r}: carry the "
            "group on with per_layer=False, or scale the model per layer "
            "before training")
    if scale is not None:
        scale = checks.finite_float32("scale", scale, above=0)
    loss_scale = group_lib.underlying(old.loss_scale)
    with model.distribute_strategy.scope():
        new_scale = type(loss_scale).from_config(loss_scale.get_config())
        shared = new_scale if group is None else group_lib.LossScaleGroup(
            new_scale, skip=group.skip)
        news = [loss_scale_optimizer.LossScaleOptimizer(
            type(o.inner_optimizer).from_config(
                o.inner_optimizer.get_config()), loss_scale=shared)
                for o in olds]
    fixed = report.fix(model, optimizer=news[olds.index(old)], also=also,
                       per_layer=per_layer)
    if fixed.optimizer is not news[0] and group is None:
        # Made scaled per layer anew, the model has an optimizer of its own,
        # of the same configs: it takes the state.
        news = [fixed.optimizer]
        new_scale = group_lib.underlying(fixed.optimizer.loss_scale)
    with fixed.distribute_strategy.scope():
        if group is None:
            news[0].build(fixed.trainable_variables)
        else:
            # The fixed model's variables come in the order of `model`'s.
            places = {id(v): i for i, v in enumerate(model.trainable_variables)}
            targets = fixed.trainable_variables
            for o, n in zip(olds, news):
                n.build([targets[places[id(v)]]
                         for v in optimizer_protocol.built_for(o)])
    for o, n in zip(olds, news):
        _copy(model, o, n)
    if scale is not None and new_scale.variables:
        # The first state variable is the scale (the saved order).
        new_scale.variables[0].assign(scale)
    carry_scaling_state(model, fixed)
    return fixed if group is None else (fixed, news)


def _group_optimizers(model, group, old, optimizers):
    """`optimizers` as a list, checked to be every optimizer of `group`."""
    members = [member.optimizer for member in group.members]
    names = [getattr(o, "name", o) for o in members]
    if optimizers is None:
        raise ValueError(
            f"model.optimizer {old.name!r} is in {group!r}: pass "
            f"optimizers=[...], every optimizer of the group ({names}), to "
            "carry them on together (report.fix(model, optimizers=...) "
            "returns the fixed model and their new optimizers)")
    optimizers = list(optimizers)
    if sorted(map(id, optimizers)) != sorted(map(id, members)):
        raise ValueError(
            f"optimizers must be every optimizer of {group!r} once ("
            f"{names}), got {[getattr(o, 'name', o) for o in optimizers]}")
    # Each carried on is built where it was, at the same places in the
    # fixed model: it must have been built, for variables of `model`.
    ours = {id(v) for v in model.trainable_variables}
    for optimizer in optimizers:
        variables = optimizer_protocol.built_for(optimizer)
        if variables is None:
            raise ValueError(
                f"optimizers holds {optimizer.name!r}, not built yet: build "
                "it (or step it once) before carrying it on")
        others = [v.name for v in variables if id(v) not in ours]
        if others:
            raise ValueError(
                f"optimizers holds {optimizer.name!r}, built for variables "
                f"{others} that are not trainable variables of model "
                f"{model.name!r}: carrying on moves the optimizers of one "
                "model")
    return optimizers


def _variables(optimizer):
    """An optimizer's variables (tf-keras' legacy ones give theirs by a
    method)."""
    variables = optimizer.variables
    return variables() if callable(variables) else variables


def _copy(model, old, new):
    """`old`'s variables into `new`'s, one for one."""
    shapes = [[tuple(v.shape) for v in _variables(o)] for o in (old, new)]
    if shapes[0] != shapes[1]:
        raise ValueError(
            f"the optimizer of model {model.name!r} holds variables the fixed "
            f"model's cannot take one for one: {shapes[0]} against "
            f"{shapes[1]}")
    for source, target in zip(_variables(old), _variables(new)):
        target.assign(source)


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

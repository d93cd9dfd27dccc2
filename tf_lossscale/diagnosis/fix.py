"""`Float16Diagnosis.fix`: the diagnosed model rebuilt with the layers float16
cannot hold in float32, checked on the diagnosed batches and compiled."""

from tf_lossscale.diagnosis import models
from tf_lossscale.keras3 import loss_scale_optimizer


def fixed_model(model, report, arguments, diagnose):
    """`Float16Diagnosis.fix`: `report` is its `as_dict()`, `arguments` what
    `diagnose` (passed in: it makes reports, which call this) ran with."""
    models.check_model(model, "fix")
    names = [layer.name for layer in models.probed_layers(model)]
    if names != [row["name"] for row in report["layers"]]:
        raise ValueError(
            f"model {model.name!r} is not the model this report diagnosed: "
            f"its layers are {names}")
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            f"model {model.name!r} is not compiled: fix compiles its copy "
            "with the original's loss, metrics and optimizer")
    if report["input_nonfinite_batches"]:
        raise ValueError(
            f"{report['input_nonfinite_batches']} of {report['batches']} "
            "diagnosed batches hold NaN or Inf in their inputs: no choice "
            "of float32 layers makes the forward pass finite; fix the data")
    keep = set(report["keep_in_float32"])
    while True:
        fixed = models.rebuilt(model, keep)
        checked = diagnose(fixed, **arguments)
        first = checked.first_nonfinite_layer
        if first is not None and (
                fixed.get_layer(first).compute_dtype != "float16"):
            raise ValueError(
                f"the outputs of layer {first!r} of model {model.name!r} are "
                "not finite on the diagnosed batches even though it computes "
                "in float32 (NaN or Inf in its weights, or values beyond "
                "float32's range): no choice of float32 layers makes the "
                "forward pass finite")
        named = set(checked.keep_in_float32) | ({first} - {None})
        if named <= keep:
            break
        keep |= named
    # Compiled as `model` was, with a new optimizer and the new loss scale.
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    settings = {key: value for key, value in model.get_compile_config().items()
                if key not in ("optimizer", "loss")}
    keras = models.keras_module(model)
    with model.distribute_strategy.scope():
        optimizer = loss_scale_optimizer.LossScaleOptimizer(
            type(inner).from_config(inner.get_config()),
            loss_scale=checked.loss_scale())
        fixed.compile(optimizer=optimizer,
                      loss=model.loss or arguments["loss"],
                      **keras.saving.deserialize_keras_object(settings))
    return fixed

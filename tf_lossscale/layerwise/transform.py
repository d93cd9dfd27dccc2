"""`scale_per_layer`: a compiled Keras 3 model rebuilt into a `LayerwiseModel`.

The graph is cloned (`keras.models.clone_model` with a `call_function`) with
a `GradientScaling` layer on every edge from one segment into another, and
after every output of a segment below the last.
"""

import contextlib

import keras

from tf_lossscale._internal import checks
from tf_lossscale.keras3 import loss_scale_optimizer
from tf_lossscale.layerwise import boundary
from tf_lossscale.layerwise import model as model_lib
from tf_lossscale.layerwise import rule as rule_lib
from tf_lossscale.layerwise import segments as segments_lib
from tf_lossscale.loss_scales import serialization
from tf_lossscale.step import optimizer_protocol

_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def scale_per_layer(model, segments="layers", *, increment_period=2000,
                    min_factor=2.0 ** -40, max_factor=2.0 ** 40):
    """A new compiled model: `model` with per-layer gradient scaling.

    Each segment of the new model runs its backward pass at its own scale,
    S * F (S the loss scale, F its factor, 1 for the last segment), and
    each gradient is unscaled by its segment's S * F; `model` is left as it
    was. What it does, when to use it, and what it costs:
    docs/guides/per-layer-scaling.md.

    Args:
      model: a compiled Keras 3 functional or Sequential model (built, on
        `keras.Input`).
      segments: where segments start, among the model's top-level layers in
        the order it runs them: "layers" (the default) starts one at every
        layer with trainable weights but a normalization (batch, layer or
        group); an int n cuts those layers into n consecutive groups of
        about the same count; a list of layer names starts one at each of
        them; a dict `{layer name or path: largest gradient}` (float32, at
        loss scale 1: `Float16Diagnosis.gradient_maxima()`) starts one
        where a layer's largest gradient parts from its segment's first
        layer's by more than 2**8 (`segments.PARTING_LOG2`), so that layers
        one scale holds share one. The other layers join the segment before
        them; a nested model is one layer.
      increment_period: finite steps after which a segment's margin doubles
        (up to 1), a positive int.
      min_factor, max_factor: the bounds of every factor, numbers > 0 (both
        1: the single-scale wrapper, bit for bit).

    Returns:
      A `LayerwiseModel` with `model`'s weights, compiled as `model` was,
      with a new `tf_lossscale.LossScaleOptimizer` around a new inner
      optimizer from the original's config, and a new loss scale from the
      original wrapper's config (a `DynamicLossScale` if it was no
      `tf_lossscale` wrapper). Made under `model`'s distribution strategy.

    Raises:
      TypeError: `model` is not a compiled Keras 3 functional or Sequential
        model (subclassed, tf-keras, not built), or cannot be rebuilt from
        its layers' configs.
      ValueError: `model` is scaled per layer already; `segments` names no
        layer, or makes fewer than two segments (magnitudes that do not
        part); a bad `increment_period`, `min_factor` or `max_factor`.
    """
    rule = rule_lib.checked_rule(increment_period, min_factor, max_factor)
    view = _functional_view(model)
    units = [layer for layer in view.layers
             if not isinstance(layer, keras.layers.InputLayer)]
    segment_of = segments_lib.segment_layers(units, segments)
    count = max(segment_of.values()) + 1
    names = [[u.name for u in units if segment_of[u.name] == k]
             for k in range(count)]
    # Under the model's own policy, as it was built.
    with model.distribute_strategy.scope(), _global_policy(model.dtype_policy):
        scaled = _rebuilt(view, segment_of, count - 1)
        scaled._set_up_scaling(names, rule)  # pylint: disable=protected-access
        for unit in units:
            copy = scaled.get_layer(unit.name)
            if copy.dtype_policy.name != unit.dtype_policy.name:
                raise TypeError(
                    f"could not rebuild layer {unit.name!r} of model "
                    f"{model.name!r} with its dtype policy "
                    f"{unit.dtype_policy.name!r} (got "
                    f"{copy.dtype_policy.name!r})")
            copy.set_weights(unit.get_weights())
        _compile_as(scaled, model)
    return scaled


def _functional_view(model):
    """`model` as a functional model over the same layers; refuses what
    cannot be rebuilt."""
    if optimizer_protocol.comes_from_tf_keras(model):
        raise TypeError(
            f"model {getattr(model, 'name', '')!r} is a tf-keras model: "
            "per-layer scaling rebuilds Keras 3 functional and Sequential "
            "models")
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"model must be a Keras 3 model, got {checks.summary(model)}")
    if isinstance(model, model_lib.LayerwiseModel):
        raise ValueError(f"model {model.name!r} is scaled per layer already")
    if getattr(model, "optimizer", None) is None:
        raise TypeError(
            f"model {model.name!r} is not compiled: scale_per_layer compiles "
            "its copy with the original's loss, metrics and optimizer")
    if isinstance(model, keras.Sequential):
        if not model.built or not model.inputs:
            raise TypeError(
                f"model {model.name!r} is not built: give it a keras.Input "
                "(or call it once) before scale_per_layer")
        # One input and one output, as tensors: the model is called so.
        return keras.Model(model.inputs[0], model.outputs[0],
                           name=model.name)
    if not getattr(model, "inputs", None):
        raise TypeError(
            f"model {model.name!r} has no graph of layers (a subclassed "
            "model): scale_per_layer rebuilds functional and Sequential "
            "models built on keras.Input")
    return model


@contextlib.contextmanager
def _global_policy(policy):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _from_config(layer):
    """A new layer from `layer`'s config. A model's config holds no dtype
    policy of its own: a nested one is rebuilt under its own as the global
    one, as it was built (its layers' configs hold theirs)."""
    if not isinstance(layer, keras.Model):
        return layer.__class__.from_config(layer.get_config())
    with _global_policy(layer.dtype_policy):
        return layer.__class__.from_config(layer.get_config())


def _wider(producer_dtype, consumer_dtype):
    """The dtype a boundary computes in: the wider of its two sides."""
    return max((producer_dtype, consumer_dtype),
               key=lambda name: _WIDTH.get(name, 0))


def _rebuilt(view, segment_of, top):
    """The clone of `view` with boundaries, as a `LayerwiseModel`."""
    originals = {}  # id(clone) -> original layer
    tensor_segment = {}  # id(KerasTensor of the clone) -> segment
    boundaries = {}  # (id(tensor), consumer segment) -> boundary output
    made = []

    def clone(layer):
        try:
            copy = _from_config(layer)
        except Exception as err:  # pylint: disable=broad-except
            if layer.weights:
                raise TypeError(
                    f"could not rebuild layer {layer.name!r} from its config "
                    f"({type(err).__name__}: {err}); its class must be "
                    "serializable (register_keras_serializable)") from err
            # A layer without state (a Lambda, in Keras' safe mode) is
            # shared with the original model.
            copy = layer
        originals[id(copy)] = layer
        return copy

    def crossing(tensor, segment, consumer_dtype):
        """`tensor`, through a boundary if it comes from another segment."""
        producer = tensor_segment.get(id(tensor))
        if not isinstance(tensor, keras.KerasTensor) or producer is None or (
                producer == segment) or not keras.backend.is_float_dtype(
                    tensor.dtype):
            return tensor
        key = (id(tensor), segment)
        if key not in boundaries:
            layer = boundary.GradientScaling(
                producer, segment, name=f"gradient_scaling_{len(made)}",
                dtype=_wider(keras.backend.standardize_dtype(tensor.dtype),
                             consumer_dtype))
            made.append(layer)
            boundaries[key] = layer(tensor)
        return boundaries[key]

    def call(layer, *args, **kwargs):
        original = originals.get(id(layer), layer)
        segment = segment_of[original.name]
        dtype = layer.dtype_policy.compute_dtype
        args, kwargs = keras.tree.map_structure(
            lambda t: crossing(t, segment, dtype), (args, kwargs))
        outputs = layer(*args, **kwargs)
        for tensor in keras.tree.flatten(outputs):
            tensor_segment[id(tensor)] = segment
        return outputs

    # New inputs named as the model's (clone_model names them after their
    # tensors).
    input_names = {id(layer.output): layer.name for layer in view.layers
                   if isinstance(layer, keras.layers.InputLayer)}
    inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype,
                              name=input_names.get(id(t))), view.input)
    clone_model = keras.models.clone_model(
        keras.Model(view.input, view.output, name=view.name),
        input_tensors=inputs, clone_function=clone, call_function=call)
    outputs = keras.tree.map_structure(
        lambda t: crossing(t, top, keras.backend.standardize_dtype(t.dtype)),
        clone_model.output)
    return model_lib.LayerwiseModel(clone_model.input, outputs,
                                    name=view.name)


def _compile_as(scaled, model):
    """Compiles `scaled` as `model` was, with a new optimizer."""
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner = type(inner).from_config(inner.get_config())
    if isinstance(optimizer, loss_scale_optimizer.LossScaleOptimizer):
        wrapped = loss_scale_optimizer.LossScaleOptimizer(
            inner, loss_scale=serialization.deserialize(
                serialization.serialize(optimizer.loss_scale)))
    else:
        wrapped = loss_scale_optimizer.LossScaleOptimizer(inner)
    settings = {key: value
                for key, value in model.get_compile_config().items()
                if key not in ("optimizer", "loss")}
    scaled.compile(optimizer=wrapped, loss=model.loss,
                   **keras.saving.deserialize_keras_object(settings))

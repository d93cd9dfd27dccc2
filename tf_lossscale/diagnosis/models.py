"""The models a float16 diagnosis runs: a probe of the model's own layers,
and copies rebuilt from its config (not by `clone_model`, which keeps each
layer's dtype policy and fails on a compiled lambda loss) with chosen layers
computing in float32."""

import importlib

import tensorflow as tf

from tf_lossscale.step import optimizer_protocol
from tf_lossscale._internal import checks

_FLOAT16_POLICIES = ("mixed_float16", "float16")


def keras_module(model):
    """The Keras that made `model`: keras (3) or tf_keras."""
    return importlib.import_module(
        "tf_keras" if optimizer_protocol.comes_from_tf_keras(model)
        else "keras")


def probed_layers(model):
    """The model's top-level layers other than its inputs, in the order the
    model runs them."""
    return [layer for layer in model.layers
            if type(layer).__name__ != "InputLayer"]


def check_model(model, caller="diagnose"):
    """Raises TypeError unless `model` is a model `caller` can run."""
    if not hasattr(model, "layers") or not callable(model):
        raise TypeError(
            f"model must be a Keras model, got {checks.summary(model)}")
    if isinstance(model, keras_module(model).Sequential):
        if not model.built:
            raise TypeError(
                f"model {model.name!r} is not built: build it (give it a "
                f"keras.Input or call it once) before {caller}")
        return
    if not getattr(model, "inputs", None):
        raise TypeError(
            f"model {model.name!r} has no inputs graph: {caller} supports "
            "functional and Sequential models (Keras 3 or tf-keras) built on "
            "keras.Input; a subclassed model has no per-layer outputs to read")
    if len(model.outputs) != 1:
        raise TypeError(
            f"model {model.name!r} has {len(model.outputs)} outputs; "
            f"{caller} supports models with one output")


def probe(model):
    """A function of a batch's inputs that runs the model's own layers
    (`training=False`) and returns `(layer_outputs, output)`: each probed
    layer's output tensors, and the model's output. A Sequential model runs
    its layers in turn (one rebuilt from its config keeps a first, unused
    graph in its layers)."""
    layers = probed_layers(model)
    if isinstance(model, keras_module(model).Sequential):

        def run_sequential(x):
            layer_outputs = []
            for layer in layers:
                x = layer(x, training=False)
                layer_outputs.append(tf.nest.flatten(x))
            return layer_outputs, x

        return run_sequential
    try:
        structure = [[tf.nest.flatten(layer.output) for layer in layers],
                     model.outputs[0]]
    except (AttributeError, ValueError, RuntimeError) as err:
        raise TypeError(
            "diagnose needs each layer called once in the model; a layer "
            f"has no single output ({err})") from err
    # One input as a tensor, as the model is called with it.
    inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
    probe_model = keras_module(model).Model(
        inputs=inputs, outputs=tf.nest.flatten(structure),
        name=f"{model.name}_float16_probe")
    return lambda x: tf.nest.pack_sequence_as(
        structure, tf.nest.flatten(probe_model(x, training=False)))


def float32_config(config, names=None):
    """A copy of a model config in which every float16 dtype policy (a
    layer's `dtype`: mixed_float16 or float16, a name or a serialized policy
    of Keras 3 or tf-keras) is float32: of the layers called `names` (and
    what they hold), or of every layer for None."""
    if isinstance(config, (list, tuple)):
        return type(config)(float32_config(item, names) for item in config)
    if not isinstance(config, dict):
        return config
    if names is not None and config.get("name") in names and (
            "dtype" in config or "layers" in config):
        return float32_config(config)
    config = {key: float32_config(value, names)
              for key, value in config.items()}
    policy = config.get("dtype")
    name = ((policy.get("config") or {}).get("name")
            if isinstance(policy, dict) else policy)
    if names is None and isinstance(name, str) and name in _FLOAT16_POLICIES:
        config["dtype"] = "float32" if isinstance(policy, str) else dict(
            policy, config=dict(policy["config"], name="float32"))
    return config


def rebuilt(model, names=None):
    """A copy of `model` from its config, with a copy of its weights, made
    under the model's distribution strategy: the layers called `names` (all
    for None) compute in float32, the others keep their dtype policies.

    Raises:
      TypeError: the model cannot be rebuilt from its config, or a layer
        named is still float16 in the copy.
    """
    config = float32_config(model.get_config(), names)
    try:
        with model.distribute_strategy.scope():
            copied = type(model).from_config(config)
            copied.set_weights(model.get_weights())
    except Exception as err:  # pylint: disable=broad-except
        raise TypeError(
            f"could not rebuild model {model.name!r} from its config "
            f"({type(err).__name__}: {err}); its layers must be serializable "
            "(custom layers registered with register_keras_serializable)"
        ) from err
    for layer in probed_layers(copied):
        if (names is None or layer.name in names) and (
                layer.compute_dtype == "float16"):
            raise TypeError(
                f"could not make layer {layer.name!r} compute in float32 "
                "through the model's config")
    return copied

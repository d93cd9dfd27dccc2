"""The two models a float16 diagnosis runs: a probe and a float32 twin.

* The probe is a functional model over the user's own layers (no copy,
  no new variable) whose outputs are every layer's output, then the model's
  output: calling it runs the user's model and shows what each layer
  produced, and a gradient tape can differentiate the loss with respect to
  each of those outputs.
* The twin is the same model computing in float32: rebuilt from the model's
  config with every float16 dtype policy rewritten to float32, given a copy
  of the model's weights. (`clone_model` keeps each layer's saved policy,
  so its copy still computes in float16, and it clones the compile config,
  which fails for a loss written as a lambda.) Its gradients are the
  reference a float16 gradient is compared with.

Both need a functional or Sequential model (Keras 3 or tf-keras) with one
output and each layer called once; subclassed models have no graph of
layers to read the outputs from.
"""

import copy

import tensorflow as tf

from tf_lossscale import float16_layers
from tf_lossscale import optimizer_protocol

_FLOAT16_POLICIES = ("mixed_float16", "float16")


def keras_module(model):
    """The Keras that made `model`: keras (3) or tf_keras, imported here."""
    # pylint: disable=g-import-not-at-top
    if optimizer_protocol.comes_from_tf_keras(model):
        import tf_keras
        return tf_keras
    import keras
    return keras


def probed_layers(model):
    """The model's top-level layers other than its inputs, in the order the
    model runs them."""
    return [layer for layer in model.layers
            if not float16_layers.is_input_layer(layer)]


def check_model(model):
    """Raises TypeError unless `model` is a model `diagnose` can run."""
    if not hasattr(model, "layers") or not callable(model):
        raise TypeError(f"model must be a Keras model, got {model!r}")
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise TypeError(
            f"model {model.name!r} has no inputs graph: diagnose needs a "
            "functional or Sequential model built on keras.Input (a "
            "subclassed model has no per-layer outputs to read)")
    if len(model.outputs) != 1:
        raise TypeError(
            f"model {model.name!r} has {len(model.outputs)} outputs; "
            "diagnose supports models with one output")


def _layer_outputs(layer):
    try:
        return tf.nest.flatten(layer.output)
    except (AttributeError, ValueError, RuntimeError) as err:
        raise TypeError(
            f"diagnose needs each layer called once in the model; layer "
            f"{layer.name!r} has no single output ({err})") from err


def probe(model):
    """`(probe_model, output_counts)`: the probe of `model` (see the module
    docstring) and how many tensors each probed layer outputs; the last
    output of the probe is the model's output."""
    check_model(model)
    outputs, counts = [], []
    for layer in probed_layers(model):
        layer_outputs = _layer_outputs(layer)
        outputs += layer_outputs
        counts.append(len(layer_outputs))
    outputs.append(model.outputs[0])
    probe_model = keras_module(model).Model(
        inputs=model.input, outputs=outputs,
        name=f"{model.name}_float16_probe")
    return probe_model, counts


def _is_float16_policy(value):
    if isinstance(value, str):
        return value in _FLOAT16_POLICIES
    if isinstance(value, dict):
        return (value.get("config") or {}).get("name") in _FLOAT16_POLICIES
    return False


def _float32_policy(value):
    if isinstance(value, str):
        return "float32"
    value = copy.deepcopy(value)
    value["config"]["name"] = "float32"
    return value


def float32_config(config):
    """A copy of a model config in which every float16 dtype policy (a
    layer's `dtype`: mixed_float16 or float16, as a name or a serialized
    policy of Keras 3 or tf-keras) is float32."""
    if isinstance(config, dict):
        return {key: (_float32_policy(value)
                      if key == "dtype" and _is_float16_policy(value)
                      else float32_config(value))
                for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(float32_config(item) for item in config)
    return config


def float32_twin(model):
    """A float32 copy of `model` with a copy of its weights, made under the
    model's distribution strategy.

    Raises:
      TypeError: the model cannot be rebuilt from its config.
    """
    config = float32_config(model.get_config())
    try:
        with model.distribute_strategy.scope():
            twin = type(model).from_config(config)
            twin.set_weights(model.get_weights())
    except Exception as err:  # pylint: disable=broad-except
        raise TypeError(
            f"diagnose could not rebuild model {model.name!r} in float32 from "
            f"its config ({type(err).__name__}: {err}); its layers must be "
            "serializable (custom layers registered with "
            "register_keras_serializable)") from err
    for layer in probed_layers(twin):
        if float16_layers.compute_dtype(layer) == "float16":
            raise TypeError(
                f"diagnose could not make layer {layer.name!r} compute in "
                "float32 through the model's config")
    return twin

"""The two models a float16 diagnosis runs: a probe and a float32 twin.

* The probe runs the user's own layers (no copy, no new variable) and
  returns every layer's output, then the model's output: what each layer
  produced, which a gradient tape can differentiate the loss with respect
  to. For a functional model it is a functional model over the same
  layers; a Sequential model's layers are called one after the other.
* The twin is the same model computing in float32: rebuilt from the model's
  config with every float16 dtype policy rewritten to float32, given a copy
  of the model's weights. (`clone_model` keeps each layer's saved policy,
  so its copy still computes in float16, and it clones the compile config,
  which fails for a loss written as a lambda.) Its gradients are the
  reference a float16 gradient is compared with.

Both need a functional model (one output, each layer called once) or a
built Sequential model, of Keras 3 or tf-keras; subclassed models have no
graph of layers to read the outputs from.
"""

import copy

import tensorflow as tf

from tf_lossscale.ops import float16
from tf_lossscale.step import optimizer_protocol
from tf_lossscale._internal import checks

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
            if not float16.is_input_layer(layer)]


def _is_sequential(model):
    return isinstance(model, keras_module(model).Sequential)


def check_model(model):
    """Raises TypeError unless `model` is a model `diagnose` can run."""
    if not hasattr(model, "layers") or not callable(model):
        raise TypeError(
            f"model must be a Keras model, got {checks.summary(model)}")
    if _is_sequential(model):
        if not model.built:
            raise TypeError(
                f"model {model.name!r} is not built: build it (give it a "
                "keras.Input or call it once) before diagnose")
        return
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
    """The probe of `model`: a function of a batch's inputs that runs the
    model (`training=False`) and returns `(layer_outputs, output)`, a list
    of each probed layer's output tensors and the model's output.

    A Sequential model runs its layers one after the other, as it does
    itself (a Sequential rebuilt from its config keeps a first, unused
    graph in its layers); a functional model runs a functional model over
    its layers whose outputs are all theirs.
    """
    check_model(model)
    layers = probed_layers(model)
    if _is_sequential(model):

        def run_sequential(x):
            layer_outputs = []
            for layer in layers:
                x = layer(x, training=False)
                layer_outputs.append(tf.nest.flatten(x))
            return layer_outputs, x

        return run_sequential
    outputs, counts = [], []
    for layer in layers:
        layer_outputs = _layer_outputs(layer)
        outputs += layer_outputs
        counts.append(len(layer_outputs))
    outputs.append(model.outputs[0])
    # One input as a tensor, as the model is called with it.
    inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
    probe_model = keras_module(model).Model(
        inputs=inputs, outputs=outputs, name=f"{model.name}_float16_probe")

    def run_functional(x):
        flat = tf.nest.flatten(probe_model(x, training=False))
        layer_outputs, start = [], 0
        for count in counts:
            layer_outputs.append(flat[start:start + count])
            start += count
        return layer_outputs, flat[-1]

    return run_functional


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
        if float16.compute_dtype(layer) == "float16":
            raise TypeError(
                f"diagnose could not make layer {layer.name!r} compute in "
                "float32 through the model's config")
    return twin

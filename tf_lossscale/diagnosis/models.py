"""The models a float16 diagnosis runs: copies of the model (rebuilt from its
config, with its weights and chosen layers in float32), the leaf layers it
reports on, and the recording of their outputs as the copies run.

Rows are named by layer paths: a layer of the model by its name, a layer
inside a nested model by the names down to it (`"ffn/dense_1"`).
"""

import contextlib
import importlib
import random
import threading

import numpy as np
import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale._internal import private_api
from tf_lossscale.layerwise import boundary
from tf_lossscale.step import optimizer_protocol

_FLOAT16_POLICIES = ("mixed_float16", "float16")
# Every layer float32: the float32 twin.
ALL = "all"
# Layers that draw random numbers in training, and the attributes that turn
# them off (a rate or deviation of 0): dropout and noise layers, and the
# dropout of recurrent cells.
_RANDOM_ATTRIBUTES = {
    "Dropout": ("rate",), "SpatialDropout1D": ("rate",),
    "SpatialDropout2D": ("rate",), "SpatialDropout3D": ("rate",),
    "GaussianDropout": ("rate",), "AlphaDropout": ("rate",),
    "GaussianNoise": ("stddev",),
}
_RECURRENT_DROPOUT = ("dropout", "recurrent_dropout")


def keras_module(model):
    """The Keras that made `model`: keras (3) or tf_keras."""
    return importlib.import_module(
        "tf_keras" if optimizer_protocol.comes_from_tf_keras(model)
        else "keras")


def _is_model(layer, keras):
    return isinstance(layer, keras.Model)


def leaf_layers(model):
    """`[(path, layer)]`: the layers of `model` and of the models nested in
    it (not the layers inside a layer), in the model's order; no inputs, no
    per-layer scaling boundaries."""
    keras = keras_module(model)
    leaves = []

    def walk(container, prefix):
        for layer in container.layers:
            # Per-layer scaling's boundaries compute nothing forward.
            if type(layer).__name__ == "InputLayer" or isinstance(
                    layer, boundary.GradientScaling):
                continue
            path = prefix + layer.name
            if _is_model(layer, keras):
                walk(layer, path + "/")
            else:
                leaves.append((path, layer))

    walk(model, "")
    return leaves


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
            "keras.Input, and models nested in them; a subclassed model "
            "cannot be rebuilt from its config")
    if len(model.outputs) != 1:
        raise TypeError(
            f"model {model.name!r} has {len(model.outputs)} outputs; "
            f"{caller} supports models with one output")


def _float32_policy(policy):
    """`policy` (a layer config's `dtype`: a name or a serialized policy of
    Keras 3 or tf-keras) with float32 for a float16 one; else itself."""
    name = ((policy.get("config") or {}).get("name")
            if isinstance(policy, dict) else policy)
    if not isinstance(name, str) or name not in _FLOAT16_POLICIES:
        return policy
    return "float32" if isinstance(policy, str) else dict(
        policy, config=dict(policy["config"], name="float32"))


def float32_config(config, paths=ALL, prefix=""):
    """A copy of a model config in which every float16 dtype policy is
    float32: of the layers at `paths` (and what they hold), or of every
    layer for `ALL`. Paths descend through nested models' `layers`."""
    if isinstance(config, (list, tuple)):
        return type(config)(float32_config(item, paths, prefix)
                            for item in config)
    if not isinstance(config, dict):
        return config
    inner = config.get("config")
    if paths != ALL and isinstance(inner, dict) and "name" in inner:
        path = prefix + inner["name"]
        if path in paths:
            return float32_config(config, ALL)
        if "layers" in inner:
            return dict(config, config=dict(inner, layers=float32_config(
                inner["layers"], paths, path + "/")))
        return config
    config = {key: float32_config(value, paths, prefix)
              for key, value in config.items()}
    if paths == ALL and "dtype" in config:
        config["dtype"] = _float32_policy(config["dtype"])
    return config


def _config_paths(config, prefix=""):
    """The paths of the layers a model config describes, nested models'
    layers included."""
    paths = set()
    for item in config.get("layers", ()):
        inner = item.get("config") if isinstance(item, dict) else None
        if isinstance(inner, dict) and "name" in inner:
            path = prefix + inner["name"]
            paths.add(path)
            paths |= _config_paths(inner, path + "/")
    return paths


def unsaved_float32(model, paths):
    """Those of the leaf layer `paths` whose float32 policy `model`'s config
    cannot hold: layers made inside a layer whose config lists no layers."""
    return set(paths) - _config_paths(model.get_config())


def _all_layers(layer):
    """`layer` and every layer inside it, depth first."""
    return list(private_api.flatten_layers(layer))


def _under(path, paths):
    return paths == ALL or any(
        path == p or path.startswith(p + "/") for p in paths)


@contextlib.contextmanager
def _random_state_kept():
    """Building layers draws seeds from Python's and numpy's generators:
    their states are given back, so the caller's random state is kept."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def _float32_name(policy):
    return "float32" if policy.name in _FLOAT16_POLICIES else policy.name


def copy(model, float32=()):
    """A copy of `model` from its config, with a copy of its weights, made
    under the model's distribution strategy: the leaf layers at the paths
    `float32` (every layer for `ALL`) and the layers inside them compute in
    float32, every other layer as in `model`. Python's and numpy's random
    states are left as they were.

    Raises:
      TypeError: the model cannot be rebuilt from its config, or a layer
        does not compute as intended in the copy.
    """
    keras = keras_module(model)
    config = float32_config(model.get_config(), float32)
    global_policy = keras.mixed_precision.global_policy()
    try:
        with _random_state_kept(), model.distribute_strategy.scope():
            # Layers whose config names no policy (nested models) take the
            # global one when rebuilt.
            if float32 == ALL:
                keras.mixed_precision.set_global_policy("float32")
            copied = type(model).from_config(config)
            copied.set_weights(model.get_weights())
    except Exception as err:  # pylint: disable=broad-except
        raise TypeError(
            f"could not rebuild model {model.name!r} from its config "
            f"({type(err).__name__}: {err}); its layers must be serializable "
            "(custom layers registered with register_keras_serializable)"
        ) from err
    finally:
        keras.mixed_precision.set_global_policy(global_policy)
    _align_policies(model, copied, float32)
    return copied


def _layers_in_leaves(model):
    """`[(leaf path, layer)]` for every layer inside `model`'s leaf layers,
    the leaves included."""
    return [(path, layer) for path, leaf in leaf_layers(model)
            for layer in _all_layers(leaf)]


def _align_policies(model, copied, float32):
    """Makes each layer of `copied` compute as intended where its config
    could not say so (layers a KerasHub backbone or a custom layer makes
    itself, which take the policy given to their maker or the global one):
    with Keras 3's `dtype_policy` setter. Raises TypeError naming a layer
    that still does not."""
    keras = keras_module(model)
    original, rebuilt = _layers_in_leaves(model), _layers_in_leaves(copied)
    # Layers a layer makes itself may be named otherwise in the copy.
    if [(p, type(l)) for p, l in original] != [
            (p, type(l)) for p, l in rebuilt]:
        raise TypeError(
            f"could not rebuild model {model.name!r} from its config: the "
            "copy's layers differ from the model's")
    for (path, layer), (_, twin) in zip(original, rebuilt):
        intended = (_float32_name(layer.dtype_policy)
                    if _under(path, float32) else layer.dtype_policy.name)
        if twin.dtype_policy.name == intended:
            continue
        if keras.__name__ == "keras":
            twin.dtype_policy = intended
        if twin.compute_dtype != keras.mixed_precision.Policy(
                intended).compute_dtype:
            leaf = dict(leaf_layers(model))[path]
            name = path if layer is leaf else f"{path}/{layer.name}"
            raise TypeError(
                f"could not make layer {name!r} of model {model.name!r} "
                f"compute in {intended} in a copy rebuilt from its config "
                f"(it computes in {twin.compute_dtype})")


def random_layers_off(model):
    """Turns off, in `model` (a copy), the layers that draw random numbers
    in training (dropout, noise, recurrent dropout), so that its float16
    and float32 runs compute the same function."""
    for _, leaf in leaf_layers(model):
        for layer in _all_layers(leaf):
            names = _RANDOM_ATTRIBUTES.get(type(layer).__name__, ())
            if not names and any(type(base).__name__ in _RANDOM_ATTRIBUTES
                                 for base in type(layer).__mro__[1:]):
                names = ("rate",)
            if "recurrent_dropout" in vars(layer):  # A recurrent cell.
                names += _RECURRENT_DROPOUT
            for name in names:
                if isinstance(vars(layer).get(name), (int, float)):
                    object.__setattr__(layer, name, 0.0)


def variable_holders(model):
    """`{id(variable): (leaf path, layer)}` for the trainable variables of
    `model`'s leaf layers: the leaf that holds each, and the innermost layer
    inside it that does (whose dtype policy its gradient has)."""
    holders = {}
    for path, leaf in leaf_layers(model):
        # Each layer before the layers it holds: the innermost comes last.
        for layer in _all_layers(leaf):
            for variable in layer.trainable_weights:
                holders[id(variable)] = (path, layer)
    return holders


class Recorder:
    """Records the outputs of a model's leaf layers each time they run, per
    thread (MirroredStrategy runs each replica in a thread of its own):
    `with recorder.recording() as records:` around a call of the model
    fills `records` with `(leaf index, [output tensors])`, in call order.
    The model is a copy: `call` of its leaf layers is replaced."""

    def __init__(self, model):
        self._local = threading.local()
        self.leaves = leaf_layers(model)
        for index, (_, layer) in enumerate(self.leaves):
            self._wrap(layer, index)

    def _wrap(self, layer, index):
        call = layer.call
        local = self._local

        def recorded_call(*args, **kwargs):
            outputs = call(*args, **kwargs)
            records = getattr(local, "records", None)
            if records is not None:
                records.append((index, [
                    t for t in tf.nest.flatten(outputs)
                    if tf.is_tensor(t) and t.dtype.is_floating]))
            return outputs

        # On the instance, past Keras' attribute tracking: Keras looks
        # `call` up on the layer each time it runs it.
        object.__setattr__(layer, "call", recorded_call)

    @contextlib.contextmanager
    def recording(self):
        self._local.records = []
        try:
            yield self._local.records
        finally:
            self._local.records = None

"""The models a float16 diagnosis runs: copies of the model (rebuilt from its
config, with its weights and chosen layers in float32), the leaf layers it
reports on, named by their paths (`"ffn/dense_1"` inside a nested model),
and the recording of their outputs as the copies run."""

import contextlib
import copy as copy_lib
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
# Layers that draw random numbers in training (and their subclasses: the
# spatial dropouts), and the attributes that turn them off (a rate or
# deviation of 0); recurrent cells' dropout is turned off too.
_RANDOM_ATTRIBUTES = {"Dropout": ("rate",), "GaussianDropout": ("rate",),
                      "AlphaDropout": ("rate",), "GaussianNoise": ("stddev",)}


def keras_module(model):
    """The Keras that made `model`: keras (3) or tf_keras."""
    return importlib.import_module(
        "tf_keras" if optimizer_protocol.comes_from_tf_keras(model)
        else "keras")


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
            if isinstance(layer, keras.Model):
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


def _all_float32(config):
    """Makes every float16 dtype policy in `config` float32, in place."""
    if isinstance(config, (list, tuple)):
        for item in config:
            _all_float32(item)
    elif isinstance(config, dict):
        for key, value in config.items():
            _all_float32(value)
            if key == "dtype":
                config[key] = _float32_policy(value)


def _config_layers(config, prefix=""):
    """`(path, layer config)` of each layer a model config lists, nested
    models' layers included."""
    for item in config.get("layers", ()):
        inner = item.get("config") if isinstance(item, dict) else None
        if isinstance(inner, dict) and "name" in inner:
            path = prefix + inner["name"]
            yield path, item
            yield from _config_layers(inner, path + "/")


def float32_config(config, paths=ALL):
    """A copy of a model config in which every float16 dtype policy is
    float32: of the layers at `paths` (and what they hold), or of every
    layer for `ALL`."""
    config = copy_lib.deepcopy(config)
    targets = [config] if paths == ALL else [
        item for path, item in _config_layers(config) if path in paths]
    for target in targets:
        _all_float32(target)
    return config


def unsaved_float32(model, paths):
    """Those of the leaf layer `paths` whose float32 policy `model`'s config
    cannot hold: layers made inside a layer whose config lists no layers."""
    return set(paths) - {path for path, _ in _config_layers(
        model.get_config())}


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
    each before the layers it holds, the leaves included."""
    return [(path, layer) for path, leaf in leaf_layers(model)
            for layer in private_api.flatten_layers(leaf)]


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
        intended = layer.dtype_policy.name
        if _under(path, float32):
            intended = _float32_policy(intended)
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
    for _, layer in _layers_in_leaves(model):
        names = next((_RANDOM_ATTRIBUTES[cls.__name__]
                      for cls in type(layer).__mro__
                      if cls.__name__ in _RANDOM_ATTRIBUTES), ())
        if "recurrent_dropout" in vars(layer):  # A recurrent cell.
            names += ("dropout", "recurrent_dropout")
        for name in names:
            if isinstance(vars(layer).get(name), (int, float)):
                object.__setattr__(layer, name, 0.0)


def variable_holders(model):
    """`{id(variable): (leaf path, layer)}` for the trainable variables of
    `model`'s leaf layers: the leaf that holds each, and the innermost layer
    inside it that does (whose dtype policy its gradient has)."""
    # Each layer comes before the layers it holds: the innermost last.
    return {id(variable): (path, layer)
            for path, layer in _layers_in_leaves(model)
            for variable in layer.trainable_weights}


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

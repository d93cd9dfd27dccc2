"""Turning identifiers and configs into loss scales, and back.

The serialized form is the one Keras wrote for loss scales in TF 2.1-2.3,
``{"class_name": "DynamicLossScale", "config": {...}}``, so configs saved then
load unchanged. The keys `module` and `registered_name` that Keras 3 adds to
serialized objects are accepted and ignored.
"""

import numbers

import numpy as np

from tf_lossscale import loss_scale as loss_scale_lib

_BUILT_IN = {
    cls.__name__: cls
    for cls in (loss_scale_lib.FixedLossScale,
                loss_scale_lib.DynamicLossScale)
}
_IGNORED_KEYS = frozenset({"module", "registered_name"})


def serialize(loss_scale):
    """Returns a JSON-able dict `{"class_name": ..., "config": {...}}`."""
    if not isinstance(loss_scale, loss_scale_lib.LossScale):
        raise TypeError(
            f"loss_scale must be a tf_lossscale.LossScale, got {loss_scale!r}")
    return {
        "class_name": type(loss_scale).__name__,
        "config": loss_scale.get_config(),
    }


def deserialize(config, custom_objects=None):
    """Creates a loss scale from the output of `serialize`.

    Args:
      config: a dict with keys `class_name` and `config`.
      custom_objects: optional dict mapping class names to `LossScale`
        subclasses of your own.

    Raises:
      TypeError: `config` is not such a dict.
      ValueError: the class name is unknown, or keys are missing or extra.
    """
    if not isinstance(config, dict):
        raise TypeError(
            "config must be a dict like {'class_name': 'DynamicLossScale', "
            f"'config': {{...}}}}, got {config!r}")
    keys = set(config) - _IGNORED_KEYS
    if keys != {"class_name", "config"}:
        raise ValueError(
            "config must have exactly the keys 'class_name' and 'config', "
            f"got {config!r}")
    class_name = config["class_name"]
    classes = {**_BUILT_IN, **(custom_objects or {})}
    if class_name not in classes:
        raise ValueError(
            f"Unknown loss scale class_name {class_name!r} in {config!r}; "
            f"expected one of {sorted(classes)} (pass your own classes in "
            "custom_objects)")
    cls = classes[class_name]
    if not (isinstance(cls, type)
            and issubclass(cls, loss_scale_lib.LossScale)):
        raise TypeError(
            f"custom_objects[{class_name!r}] must be a LossScale subclass, "
            f"got {cls!r}")
    if not isinstance(config["config"], dict):
        raise TypeError(
            f"config['config'] must be a dict of constructor arguments, got "
            f"{config['config']!r}")
    return cls.from_config(config["config"])


def get(identifier):
    """Returns a loss scale for `identifier`.

    * an int or float: a `FixedLossScale` of that value;
    * `"dynamic"`: a `DynamicLossScale` with default parameters;
    * a `LossScale`: itself;
    * a dict: `deserialize(identifier)`;
    * None: None.

    Raises:
      ValueError: anything else (a bool, another string, a list, ...).
    """
    if identifier is None or isinstance(identifier, loss_scale_lib.LossScale):
        return identifier
    if isinstance(identifier, (bool, np.bool_)):
        raise ValueError(
            f"Could not interpret loss scale identifier {identifier!r}: a "
            "bool is not a loss scale; use a number, 'dynamic', a LossScale "
            "or a serialized loss scale dict")
    if isinstance(identifier, numbers.Real):
        return loss_scale_lib.FixedLossScale(identifier)
    if isinstance(identifier, str) and identifier == "dynamic":
        return loss_scale_lib.DynamicLossScale()
    if isinstance(identifier, dict):
        return deserialize(identifier)
    raise ValueError(
        f"Could not interpret loss scale identifier {identifier!r}: expected "
        "a number, 'dynamic', a LossScale, a serialized loss scale dict or "
        "None")

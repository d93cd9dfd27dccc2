"""Turning identifiers and configs into loss scales, and back.

The serialized form is the one Keras wrote for loss scales in TF 2.1-2.3,
``{"class_name": "DynamicLossScale", "config": {...}}``, so configs saved then
load unchanged. Classes a floor up register here (`register`): a
`LossScaleGroup`, and its members, serialize as
``{"class_name": "LossScaleGroup", "config": {"loss_scale": {...}, ...}}``.
The keys `module` and `registered_name` that Keras 3 adds to serialized
objects are accepted and ignored.
"""

import collections.abc
import inspect
import numbers

import numpy as np

from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.loss_scales import loss_scale as loss_scale_lib
from tf_lossscale._internal import checks

_BUILT_IN = {
    cls.__name__: cls
    for cls in (loss_scale_lib.FixedLossScale,
                dynamic_loss_scale.DynamicLossScale)
}
_IGNORED_KEYS = frozenset({"module", "registered_name"})
# Classes that are no loss scales but serialize as ones, by class name.
_REGISTERED = {}


def register(cls):
    """Class decorator: `serialize`, `deserialize` and `get` take `cls` (a
    `LossScaleGroup`, which lives a floor up) as they take loss scales. A
    loss scale whose `group` is a `cls` serializes as that group; configs
    load with `cls.from_config(config, custom_objects)`."""
    _REGISTERED[cls.__name__] = cls
    return cls


def _serializable():
    return (loss_scale_lib.LossScale, *_REGISTERED.values())


def serialize(loss_scale):
    """Returns a JSON-able dict `{"class_name": ..., "config": {...}}`; for
    a `LossScaleGroup` or one of its members, the group's."""
    group = getattr(loss_scale, "group", None)
    if isinstance(group, tuple(_REGISTERED.values())):
        loss_scale = group
    if not isinstance(loss_scale, _serializable()):
        raise TypeError(
            "loss_scale must be a tf_lossscale.LossScale, got "
            f"{checks.summary(loss_scale)}")
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
      TypeError: `config`, its `class_name` or its `config` is not of the
        type above, `custom_objects` is not a dict of LossScale subclasses,
        or the config holds an argument the class does not take.
      ValueError: the class name is unknown, or keys are missing or extra.

    Messages name the part of the config at fault and summarise the values
    (`tf_lossscale._internal.checks.summary`); the config's own values are checked
    by the class's constructor, with its argument names.
    """
    if not isinstance(config, dict):
        raise TypeError(
            "config must be a dict like {'class_name': 'DynamicLossScale', "
            f"'config': {{...}}}}, got {checks.summary(config)}")
    keys = set(config) - _IGNORED_KEYS
    if keys != {"class_name", "config"}:
        raise ValueError(
            "config must have exactly the keys 'class_name' and 'config', "
            f"got the keys {checks.summary(list(config))}")
    class_name = config["class_name"]
    if not isinstance(class_name, str):
        raise TypeError(
            "config['class_name'] must be a string naming a LossScale class, "
            f"got {checks.summary(class_name)}")
    custom_objects = {} if custom_objects is None else custom_objects
    if not isinstance(custom_objects, collections.abc.Mapping):
        raise TypeError(
            "custom_objects must be a dict mapping class names to LossScale "
            f"subclasses, got {checks.summary(custom_objects)}")
    if class_name in _REGISTERED:
        return _REGISTERED[class_name].from_config(config["config"],
                                                   custom_objects)
    classes = {**_BUILT_IN, **{key: value for key, value in
                               custom_objects.items() if isinstance(key, str)}}
    if class_name not in classes:
        raise ValueError(
            f"Unknown loss scale class_name {checks.summary(class_name)}; "
            f"expected one of {checks.summary(sorted(classes))} (pass "
            "your own classes in custom_objects)")
    cls = classes[class_name]
    if not (isinstance(cls, type)
            and issubclass(cls, loss_scale_lib.LossScale)):
        raise TypeError(
            f"custom_objects[{checks.summary(class_name)}] must be a "
            f"LossScale subclass, got {checks.summary(cls)}")
    arguments = config["config"]
    if not isinstance(arguments, dict):
        raise TypeError(
            "config['config'] must be a dict of constructor arguments, got "
            f"{checks.summary(arguments)}")
    if cls in _BUILT_IN.values():
        # Python's own message would repeat a key whole, however long, and
        # says nothing for a key that is not a string.
        accepted = list(inspect.signature(cls).parameters)
        unknown = [key for key in arguments if key not in accepted]
        if unknown:
            raise TypeError(
                f"config['config'] holds argument(s) {cls.__name__} does "
                f"not take: {checks.summary(unknown)}; it takes "
                f"{', '.join(accepted)}")
    return cls.from_config(arguments)


def get_argument(name, identifier):
    """`get(identifier)` for the argument `name` of a caller (an optimizer's
    `loss_scale`), whose errors say which argument was refused: a config's
    own messages name only its parts."""
    try:
        return get(identifier)
    except (TypeError, ValueError) as error:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(
            f"{name}={checks.summary(identifier)} was refused: "
            f"{error}") from error


def get(identifier):
    """Returns a loss scale for `identifier`.

    * an int or float: a `FixedLossScale` of that value;
    * `"dynamic"`: a `DynamicLossScale` with default parameters;
    * a `LossScale` or a `LossScaleGroup`: itself;
    * a dict: `deserialize(identifier)`;
    * None: None.

    Raises:
      ValueError: anything else (a bool, another string, a list, ...).
      TypeError, ValueError: as `deserialize`, for a malformed dict.
    """
    if identifier is None or isinstance(identifier, _serializable()):
        return identifier
    if isinstance(identifier, (bool, np.bool_)):
        raise ValueError(
            "Could not interpret loss scale identifier "
            f"{checks.summary(identifier)}: a bool is not a loss scale; "
            "use a number, 'dynamic', a LossScale or a serialized loss scale "
            "dict")
    if isinstance(identifier, numbers.Real):
        return loss_scale_lib.FixedLossScale(identifier)
    if isinstance(identifier, str) and identifier == "dynamic":
        return dynamic_loss_scale.DynamicLossScale()
    if isinstance(identifier, dict):
        return deserialize(identifier)
    raise ValueError(
        "Could not interpret loss scale identifier "
        f"{checks.summary(identifier)}: expected a number, 'dynamic', a "
        "LossScale, a serialized loss scale dict or None")

"""Reading the LossScaleOptimizer configs that earlier Keras versions wrote.

Four shapes are met in saved models and config files:

* tf_lossscale: ``{"name", "inner_optimizer", "loss_scale": <serialized>}``;
* Keras 3: ``{"name", "inner_optimizer", "initial_scale",
  "dynamic_growth_steps"}``, sometimes with base-optimizer keys left at their
  defaults (``"weight_decay": None``, ...);
* tf-keras 2.4 and later: ``{"inner_optimizer", "dynamic", "initial_scale",
  "dynamic_growth_steps"}``, where ``dynamic=False`` means a fixed scale of
  ``initial_scale``;
* TF 2.1-2.3: ``{"optimizer", "loss_scale": {"class_name", "config"}}``.

`to_constructor_arguments` maps each to the arguments of
`tf_lossscale.LossScaleOptimizer`; the constructor validates the arguments.
Here only the shape is checked, so that a config that is not a dict, has
non-string keys or an inner optimizer that is not a serialized optimizer
(`"inner_optimizer": null` in a crafted file) is refused with a message
naming that part, before Keras' deserializer meets it.
"""

import collections.abc

from tf_lossscale._internal import checks

# Keys that tf-keras 2.11+ wrote into optimizer configs; Keras 3 optimizers
# reject them although they never change what an optimizer computes.
_TF_KERAS_ONLY_OPTIMIZER_KEYS = ("is_legacy_optimizer", "jit_compile")


def _strip_tf_keras_only_keys(inner_config):
    if not isinstance(inner_config, dict) or not isinstance(
            inner_config.get("config"), dict):
        return inner_config
    inner_config = dict(inner_config)
    inner_config["config"] = {
        key: value for key, value in inner_config["config"].items()
        if key not in _TF_KERAS_ONLY_OPTIMIZER_KEYS
    }
    return inner_config


def to_constructor_arguments(config, custom_objects=None):
    """Returns `(inner_optimizer_config, kwargs)` for any known config shape,
    the inner config made loadable by Keras 3.

    Raises:
      TypeError, ValueError: as `split_inner_optimizer`.
    """
    inner, kwargs = split_inner_optimizer(config, custom_objects)
    return _strip_tf_keras_only_keys(inner), kwargs


def split_inner_optimizer(config, custom_objects=None, optimizer_types=()):
    """Returns `(inner_optimizer_config, kwargs)` for any known config shape,
    the inner config as written (what tf-keras reads).

    Args:
      config: the wrapper's config.
      custom_objects: what `from_config` was given, checked here: None or a
        dict.
      optimizer_types: classes of already-deserialized inner optimizers to
        accept as they are, besides serialized ones.

    Raises:
      TypeError: `config` is not a dict with string keys, its inner
        optimizer is neither a serialized optimizer nor of `optimizer_types`,
        or `custom_objects` is not a dict.
      ValueError: `config` names no inner optimizer.
    """
    if not (custom_objects is None
            or isinstance(custom_objects, collections.abc.Mapping)):
        raise TypeError(
            "custom_objects must be a dict mapping names to classes, got "
            f"{checks.summary(custom_objects)}")
    if not isinstance(config, dict):
        raise TypeError(
            "A LossScaleOptimizer config must be a dict, got "
            f"{checks.summary(config)}")
    keys = [key for key in config if not isinstance(key, str)]
    if keys:
        raise TypeError(
            "A LossScaleOptimizer config's keys must be strings (argument "
            f"names), got {checks.summary(keys)}")
    kwargs = dict(config)
    if "inner_optimizer" in kwargs:
        key = "inner_optimizer"
    elif "optimizer" in kwargs:
        key = "optimizer"
    else:
        raise ValueError(
            "A LossScaleOptimizer config needs 'inner_optimizer' (or "
            "'optimizer' in TF <= 2.3 configs), got keys "
            f"{checks.summary(sorted(config))}")
    inner = kwargs.pop(key)
    if not isinstance(inner, optimizer_types):
        _check_serialized_optimizer(key, inner)
    return inner, kwargs


def _check_serialized_optimizer(key, inner):
    """Raises TypeError unless `inner` has the form Keras serializes an
    optimizer in: a dict with a string `class_name` (and a dict `config`;
    Keras 3 also reads a missing or null one)."""
    if (isinstance(inner, dict) and isinstance(inner.get("class_name"), str)
            and isinstance(inner.get("config", {}), (dict, type(None)))):
        return
    raise TypeError(
        f"A LossScaleOptimizer config's {key!r} must be a serialized "
        "optimizer, a dict like {'class_name': 'Adam', 'config': {...}}, got "
        f"{checks.summary(inner)}")

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
`tf_lossscale.LossScaleOptimizer`; the constructor does all validation.
"""

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


def to_constructor_arguments(config):
    """Returns `(inner_optimizer_config, kwargs)` for any known config shape,
    the inner config made loadable by Keras 3.

    Raises:
      ValueError: `config` names no inner optimizer.
    """
    inner, kwargs = split_inner_optimizer(config)
    return _strip_tf_keras_only_keys(inner), kwargs


def split_inner_optimizer(config):
    """Returns `(inner_optimizer_config, kwargs)` for any known config shape,
    the inner config as written (what tf-keras reads).

    Raises:
      ValueError: `config` names no inner optimizer.
    """
    kwargs = dict(config)
    if "inner_optimizer" in kwargs:
        inner = kwargs.pop("inner_optimizer")
    elif "optimizer" in kwargs:
        inner = kwargs.pop("optimizer")
    else:
        raise ValueError(
            "A LossScaleOptimizer config needs 'inner_optimizer' (or "
            f"'optimizer' in TF <= 2.3 configs), got keys {sorted(config)}")
    return inner, kwargs

"""The demo's configuration, read from a JSON file (`configs/demo.json`
spells out the defaults), and the options of `run` (the command line's
flags)."""

import copy
import dataclasses
import json
import math
import os
import pathlib
from typing import Any

import keras

import tf_lossscale
from tf_lossscale._internal import checks


class ConfigError(ValueError):
    """A config key or value, or an option of `run`, that cannot be used."""


def inner_optimizer(identifier):
    """A new Keras optimizer from a config's "optimizer" value."""
    if not isinstance(identifier, (str, dict)):
        raise TypeError(f"{type(identifier).__name__} is not an optimizer")
    inner_config = isinstance(identifier, dict) and identifier.get("config")
    # A second learning rate would leave it unclear which one trains.
    if isinstance(inner_config, dict) and "learning_rate" in inner_config:
        raise ValueError("it sets learning_rate; set it once, in the config "
                         "key 'learning_rate'")
    # Keras rewrites parts of a config dict it is given.
    return keras.optimizers.get(copy.deepcopy(identifier))


def _int_at_least(minimum, optional=False):
    def usable(value):
        # type() is int: JSON's true and false arrive as bools, which are ints.
        return (optional and value is None) or (
            type(value) is int and value >= minimum)  # pylint: disable=unidiomatic-typecheck
    return f"an int >= {minimum}", usable


def _optional_path(suffix=""):
    def usable(value):
        return value is None or isinstance(value, (str, os.PathLike)) and (
            os.fspath(value).lower().endswith(suffix))
    return f"a path{suffix and ' ending in ' + suffix}", usable


# What a value must be, and a check that returns whether it is (or raises
# saying why not). Config keys not listed: ints >= 1.
_KINDS = {
    "loss_scale": ("a tf_lossscale.get identifier: a number, 'dynamic' or "
                   "{'class_name': ..., 'config': {...}}", tf_lossscale.get),
    "optimizer": ("a Keras optimizer name or {'class_name': ..., "
                  "'config': {...}} without learning_rate", inner_optimizer),
    "learning_rate": ("a number > 0", lambda value: type(value) in (
        int, float) and 0 < value < math.inf),
    "num_classes": _int_at_least(2),
    "seed": _int_at_least(0),
}
# The options of `run` and the command line (None: not given).
OPTIONS = {
    "steps": _int_at_least(1, optional=True),
    "num_devices": _int_at_least(1),
    "inject_nonfinite_every": _int_at_least(0),
    "logdir": _optional_path(),
    "plot": _optional_path(".png"),
    "log_skips": ("a bool", lambda value: isinstance(value, bool)),
}


def check(name, value, kind, is_usable):
    """Raises `ConfigError` ("`name` must be `kind`, got `value`") unless
    `is_usable(value)`."""
    try:
        usable, reason = is_usable(value), ""
    except (TypeError, ValueError) as err:
        usable, reason = False, f": {err}"
    if not usable:
        raise ConfigError(
            f"{name} must be {kind}, got {checks.summary(value)}{reason}")


@dataclasses.dataclass(frozen=True)
class Config:
    """The demo's training config. Checking it creates variables: with more
    than one device, call `training.configure_devices` first."""

    loss_scale: Any = dataclasses.field(default_factory=lambda: {
        "class_name": "DynamicLossScale",
        "config": {"initial_loss_scale": 2.0**24, "increment_period": 20,
                   "multiplier": 2.0}})
    optimizer: Any = dataclasses.field(
        default_factory=lambda: {"class_name": "Adam", "config": {}})
    learning_rate: float = 0.01
    batch_size: int = 64  # The global batch.
    steps: int = 200  # Optimizer steps, applied or skipped, unless --steps.
    num_examples: int = 2048  # The synthetic dataset's size.
    input_dim: int = 16
    hidden_units: int = 32
    num_classes: int = 4
    seed: int = 1  # Of the data and the initial weights.

    def __post_init__(self):
        for field in dataclasses.fields(self):
            check(f"config key {field.name!r}", getattr(self, field.name),
                  *_KINDS.get(field.name, _int_at_least(1)))

    @classmethod
    def load(cls, path=None):
        """The config of a JSON file; the defaults for None."""
        if path is None:
            return cls()
        try:
            values = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot read config {path}: {err}") from err
        if not isinstance(values, dict):
            raise ConfigError(f"config {path} must be a JSON object, got "
                              f"{type(values).__name__}")
        keys = [field.name for field in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(keys))
        if unknown:
            raise ConfigError(f"unknown config key {unknown[0]!r}; the keys "
                              f"are {', '.join(keys)}")
        return cls(**values)

"""The demo's config and options: what each key may hold, and its default.

A config is a JSON object with keys of `SCHEMA`; missing keys take their
defaults (`configs/demo.json` spells them out). `OPTIONS` are the arguments of
`run` that the command line also takes as flags. Every value is checked by
one routine, so a config key and a flag that are wrong say so the same way:
`ConfigError: <name> must be <kind>, got <value>`.
"""

import copy
import dataclasses
import json
import math
import pathlib
from typing import Any, Callable

import keras

import tf_lossscale


class ConfigError(ValueError):
    """A config value or an option that cannot be used; names the key."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One config key or option: what its value must be (`kind`, for the
    error message), its `default`, and `check`, which returns whether a value
    is usable or raises TypeError/ValueError saying why not."""

    kind: str
    default: Any
    check: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class Option:
    """An option of `run`: its `Field` and the type of its command-line flag
    ("integer", "string" or "bool")."""

    field: Field
    flag_type: str


def check(name, field, value):
    """Raises ConfigError unless `value` is usable for `field` (called `name`
    in the message)."""
    try:
        usable, reason = field.check(value), ""
    except (TypeError, ValueError) as err:
        usable, reason = False, f": {err}"
    if not usable:
        raise ConfigError(f"{name} must be {field.kind}, got {value!r}{reason}")


def _is_int(value):
    # JSON true/false arrive as bools, which Python counts as ints.
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(default, minimum, meaning, optional=False):
    return Field(f"an int >= {minimum} ({meaning})", default,
                 lambda value: (optional and value is None) or (
                     _is_int(value) and value >= minimum))


def _path_field(meaning, suffix=""):
    return Field(f"a path{suffix and ' ending in ' + suffix} ({meaning})",
                 None, lambda value: value is None or (
                     isinstance(value, (str, pathlib.PurePath)) and
                     str(value).lower().endswith(suffix)))


def loss_scale(identifier):
    """The `LossScale` a config's "loss_scale" value names."""
    if identifier is None:
        raise ValueError("null is not a loss scale")
    return tf_lossscale.get(identifier)


def inner_optimizer(identifier):
    """A new Keras optimizer from a config's "optimizer" value."""
    if not isinstance(identifier, (str, dict)):
        raise TypeError(f"{type(identifier).__name__} is not an optimizer")
    inner_config = (identifier.get("config")
                    if isinstance(identifier, dict) else None)
    # A second learning rate would leave it unclear which one trains.
    if isinstance(inner_config, dict) and "learning_rate" in inner_config:
        raise ValueError(
            "it sets learning_rate; set it once, in the config key "
            "'learning_rate'")
    # Keras rewrites parts of a config dict it is given.
    return keras.optimizers.get(copy.deepcopy(identifier))


SCHEMA = {
    "loss_scale": Field(
        "a tf_lossscale.get identifier: a number, 'dynamic' or "
        "{'class_name': ..., 'config': {...}}",
        {"class_name": "DynamicLossScale",
         "config": {"initial_loss_scale": 2.0**24, "increment_period": 20,
                    "multiplier": 2.0}},
        loss_scale),
    "optimizer": Field(
        "a Keras optimizer name or {'class_name': ..., 'config': {...}} "
        "without learning_rate",
        {"class_name": "Adam", "config": {}},
        inner_optimizer),
    "learning_rate": Field(
        "a number > 0", 0.01, lambda value: (_is_int(value) or isinstance(
            value, float)) and 0 < value < math.inf),
    "batch_size": _int_field(64, 1, "the global batch size"),
    "steps": _int_field(200, 1, "optimizer steps when --steps is not given"),
    "num_examples": _int_field(2048, 1, "size of the synthetic dataset"),
    "input_dim": _int_field(16, 1, "features per example"),
    "hidden_units": _int_field(32, 1, "width of the hidden layer"),
    "num_classes": _int_field(4, 2, "number of classes"),
    "seed": _int_field(1, 0, "seed of the data and the initial weights"),
}


# The options of `run` and of the command line.
OPTIONS = {
    "steps": Option(_int_field(
        None, 1, "optimizer steps to train; default: the config's",
        optional=True), "integer"),
    "num_devices": Option(_int_field(
        1, 1, "replicas of a MirroredStrategy over logical CPU devices; "
        "1: no strategy"), "integer"),
    "inject_nonfinite_every": Option(_int_field(
        0, 0, "put a NaN into every N-th batch, in the last replica's part; "
        "0: never"), "integer"),
    "logdir": Option(_path_field(
        "where to write TensorBoard event files; needs the tensorboard "
        "extra"), "string"),
    "plot": Option(_path_field(
        "where to write a plot of the loss scale; needs the plot extra",
        ".png"), "string"),
    "log_skips": Option(Field(
        "a bool (print skipped steps as they happen, rate-limited, with the "
        "variables whose gradients overflowed)", False,
        lambda value: isinstance(value, bool)), "bool"),
}


def default_config():
    """A new config dict holding every key's default."""
    return {key: copy.deepcopy(field.default) for key, field in SCHEMA.items()}


def load_config(path=None):
    """Reads a JSON config (not yet validated); the defaults for None.

    Raises ConfigError if the file cannot be read or is not a JSON object.
    """
    if path is None:
        return default_config()
    try:
        config = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read config {path}: {err}") from err
    if not isinstance(config, dict):
        raise ConfigError(
            f"config {path} must be a JSON object, got {type(config).__name__}")
    return config


def validate_config(config):
    """Checks a config against `SCHEMA`; returns a copy with the defaults
    filled in. Raises ConfigError naming an unknown key or a bad value.

    Building the loss scale and the optimizer to check them creates
    variables, so under `num_devices` > 1 call `configure_devices` first.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"config must be a dict, got {config!r}")
    unknown = sorted(set(config) - set(SCHEMA))
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}; the keys are "
                          f"{', '.join(SCHEMA)}")
    completed = default_config()
    completed.update(config)
    for key, field in SCHEMA.items():
        check(f"config key {key!r}", field, completed[key])
    return completed


def check_options(options):
    """Checks `run`'s options (a dict name -> value) against `OPTIONS`."""
    for name, value in options.items():
        check(f"--{name}", OPTIONS[name].field, value)

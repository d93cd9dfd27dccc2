"""Hostile and careless argument values, for `test_hostile_inputs.py` and its
tf-keras worker (`hostile_tf_keras_worker.py`), which both import this.

* `HOSTILE`: values no message may render whole (a million-element list,
  reprs that fail, recurse or run to megabytes, a dict thousands deep, an
  int Python refuses to print). Messages are checked against them once.
* The argument tables: each argument at its own type and range edges, as
  `Case(argument, label, make, error, shows_value)`. `make(keras_module)`
  builds the value (lazily: the module is Keras 3 or tf-keras, for values
  that are optimizers); `error` is the exception expected, naming
  `argument`, and showing the value's summary when `shows_value`.

Add cases here as new hostile inputs turn up.
"""

import collections

import numpy as np
import tensorflow as tf

import tf_lossscale

# No message may be longer, whatever the input (a million-element list gave
# 7.9 MB before values were summarised).
MESSAGE_BOUND = 600

Case = collections.namedtuple("Case", "argument label make error shows_value")


class RaisingRepr:
    """An object whose repr fails."""

    def __repr__(self):
        raise RuntimeError("this repr fails")


class HugeRepr:
    """An object whose repr is ten million characters."""

    def __repr__(self):
        return "x" * 10**7


class RecursiveRepr:
    """An object whose repr recurses until Python stops it."""

    def __repr__(self):
        return repr(self)


def nested_dict(depth=5000):
    """`{"config": {"config": ...}}`, `depth` levels deep."""
    root = current = {}
    for _ in range(depth):
        current["config"] = {}
        current = current["config"]
    return root


HOSTILE = {
    "million_element_list": lambda: [1.0] * 10**6,
    "million_char_str": lambda: "9" * 10**6,
    "million_bytes": lambda: b"9" * 10**6,
    "dict_5000_deep": nested_dict,
    "100000_keys": lambda: {str(i): i for i in range(10**5)},
    "raising_repr": RaisingRepr,
    "huge_repr": HugeRepr,
    "recursive_repr": RecursiveRepr,
    "10**5000": lambda: 10**5000,
    "million_element_array": lambda: np.ones(10**6),
}


def _cases(argument, error, values, shows_value=True):
    return [Case(argument, label, make, error, shows_value)
            for label, make in values.items()]


def _constant(value):
    return lambda k: value


def _label(value):
    """`value`'s repr, the same with every numpy; a long one described."""
    text = repr(value)
    if type(value).__module__ == "numpy":
        text = f"np.{type(value).__name__}({value})"
    if len(text) < 30:
        return text
    return f"{type(value).__name__}_of_{len(text)}_chars"


def _values(*values):
    """`{label: make}` for plain values, labelled by their repr."""
    return {_label(value): _constant(value) for value in values}


def number_cases(argument, edges, optional=False, wrong_types=()):
    """A float argument: not a number (TypeError); not finite, beyond
    float32, or at its own range `edges` (ValueError)."""
    types = {**_values(True, "2", [2.0], *wrong_types),
             "tensor": lambda k: tf.constant(2.0)}
    if not optional:
        types["None"] = _constant(None)
    return (_cases(argument, TypeError, types)
            + _cases(argument, ValueError, _values(
                float("nan"), float("inf"), 3.5e38, 10**400, *edges)))


def count_cases(argument, optional=False):
    """A positive int argument: a bool, a string, a tensor or a fraction
    (TypeError); below 1, not finite or beyond int64 (ValueError)."""
    wrong_types = {"True": _constant(True), "str": _constant("3"),
                   "2.5": _constant(2.5), "np.float64(3.5)": _constant(
                       np.float64(3.5)), "tensor": lambda k: tf.constant(3)}
    if not optional:
        wrong_types["None"] = _constant(None)
    return (_cases(argument, TypeError, wrong_types)
            + _cases(argument, ValueError, _values(
                0, 0.0, -1, float("nan"), float("inf"), 2**63, 1e30)))


def bool_cases(argument, optional=False):
    """A bool argument: anything but True and False (TypeError)."""
    values = _values(1, 0, 1.0, "True", "false", [True])
    values["array"] = lambda k: np.array([True, False])
    if not optional:
        values["None"] = _constant(None)
    return _cases(argument, TypeError, values)


def choice_cases(argument):
    """A string argument taking one of a few values."""
    return (_cases(argument, TypeError, _values(None, 1, True, ["raise"]))
            + _cases(argument, ValueError, _values(
                "stop", "Raise", "", "warning", "continue ")))


FIXED_LOSS_SCALE = (
    number_cases("loss_scale_value", (
        0, 0.5, 0.999, -1, float("-inf"), 10**40, np.float64("nan")),
                 wrong_types=(False, np.bool_(True), 2 + 0j))
    + bool_cases("skip_non_finite"))

DYNAMIC_LOSS_SCALE = (
    # 1e-46 is positive, but the float32 variable would hold 0.
    number_cases("initial_loss_scale", (0, -0.5, 1e-46))
    + count_cases("increment_period")
    # 1 + 1e-9 is above 1, but float32 rounds it to 1: it would never grow.
    + number_cases("multiplier", (1, 1 + 1e-9, 0.5, 0, -2))
    # 1 - 1e-9 is below 1, but float32 rounds it to 1: it would never back off.
    + number_cases("backoff_factor", (0, 1, 1.5, -0.5, 1e-46, 1 - 1e-9),
                   optional=True)
    + number_cases("min_loss_scale", (0, -1, 1e-46))
    + number_cases("max_loss_scale", (0, -1, 1e-46), optional=True)
    + count_cases("hysteresis")
    + bool_cases("consecutive_hysteresis")
    + choice_cases("on_min_loss_scale")
    + count_cases("max_consecutive_skips", optional=True))

MONITOR = bool_cases("verbose") + bool_cases("gradient_stats")


def _already_wrapped(k):
    inner = k.optimizers.SGD()
    tf_lossscale.LossScaleOptimizer(inner)
    return inner


# `LossScaleOptimizer(inner, **{argument: value})`, or the value as the inner
# optimizer; `k` is the Keras of the inner optimizer.
OPTIMIZER = (
    _cases("inner_optimizer", TypeError, {
        "None": _constant(None), "str": _constant("sgd"), "int": _constant(3),
        "class": lambda k: k.optimizers.SGD,
        "layer": lambda k: k.layers.Dense(1)})
    + _cases("inner_optimizer", ValueError, {
        "keras_own_wrapper": lambda k: k.mixed_precision.LossScaleOptimizer(
            k.optimizers.SGD())}, shows_value=False)
    # `tf_lossscale.get`'s convention: what is no loss scale identifier is a
    # ValueError; a serialized loss scale of the wrong shape a TypeError.
    + _cases("loss_scale", ValueError, {
        **_values(None, True, "static", "Dynamic", [2.0], float("nan"),
                  float("inf"), -1, 0, 0.5, 10**400),
        "object": lambda k: object,
        "unknown_class": _constant({"class_name": "Canary", "config": {}})})
    + _cases("loss_scale", TypeError, {
        "class_name_list": _constant({"class_name": ["x"], "config": {}}),
        "config_list": lambda k: {"class_name": "FixedLossScale",
                                  "config": [2.0]},
        "value_list": lambda k: {"class_name": "FixedLossScale",
                                 "config": {"loss_scale_value": [1.0]}}})
    + _cases("name", TypeError, _values(3, b"opt", ["x"]))
    + number_cases("initial_scale", (0, -1), optional=True)
    + count_cases("dynamic_growth_steps", optional=True)
    + bool_cases("dynamic", optional=True)
    # Base-optimizer arguments, taken at their defaults only.
    + _cases("clipnorm", ValueError, {
        **_values(1.0, 0.5), "array": lambda k: np.array([1.0, 2.0])})
    + _cases("use_ema", ValueError, _values(True))
    + _cases("momentum", TypeError, _values(0.9)))

# An inner optimizer another wrapper owns.
ALREADY_WRAPPED = Case("inner_optimizer", "already_wrapped", _already_wrapped,
                       ValueError, False)

TF1_OPTIMIZER = [case for case in OPTIMIZER
                 if case.argument == "loss_scale"] + _cases(
                     "opt", ValueError, {
                         "None": _constant(None),
                         "keras_optimizer": lambda k: k.optimizers.SGD()})


def case_id(case):
    return f"{case.argument}-{case.label}"


def attempt(make):
    """Runs `make()`; returns (the exception raised or None, the names of
    the variables created meanwhile)."""
    created = []

    def creator(next_creator, **kwargs):
        created.append(kwargs.get("name"))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        try:
            make()
        except Exception as error:  # pylint: disable=broad-except
            return error, created
    return None, created

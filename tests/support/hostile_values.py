"""Hostile and careless argument values, for the constructor sweep of
`test_hostile_inputs.py` and its tf-keras subprocess
(`hostile_tf_keras_worker.py`), which both import this table.

A case is `Case(argument, label, make, error)`: `make(keras_module)` builds
the value (lazily: some are megabytes; the module is Keras 3 or tf-keras, for
values that are optimizers), `error` is the exception expected, naming
`argument` in a message shorter than `MESSAGE_BOUND`. Add cases here as new
hostile inputs turn up.
"""

import collections

import numpy as np
import tensorflow as tf

# No message may be longer, whatever the input (a million-element list gave
# 7.9 MB before values were summarised).
MESSAGE_BOUND = 600

Case = collections.namedtuple("Case", "argument label make error")


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


def _tensor(_):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.constant(2.0)


# Values no number-taking argument accepts: TypeError.
_NOT_NUMBERS = {
    "True": lambda k: True,
    "np.bool_": lambda k: np.bool_(False),
    "str": lambda k: "2",
    "bytes": lambda k: b"2",
    "list": lambda k: [2.0],
    "set": lambda k: {2.0},
    "dict": lambda k: {"value": 2.0},
    "complex": lambda k: 2 + 0j,
    "object": lambda k: object(),
    "raising_repr": lambda k: RaisingRepr(),
    "huge_repr": lambda k: HugeRepr(),
    "recursive_repr": lambda k: RecursiveRepr(),
    "array": lambda k: np.array([1.0, 2.0]),
    "tensor": _tensor,
    "million_element_list": lambda k: [1.0] * 10**6,
    "dict_5000_deep": lambda k: nested_dict(),
    "million_char_str": lambda k: "9" * 10**6,
}
# Numbers no argument takes: ValueError (10**5000 cannot even be printed).
_BAD_NUMBERS = {
    "nan": lambda k: float("nan"),
    "inf": lambda k: float("inf"),
    "-inf": lambda k: float("-inf"),
    "np.float64_nan": lambda k: np.float64("nan"),
    "-1": lambda k: -1,
    "0": lambda k: 0,
    "10**400": lambda k: 10**400,
    "10**5000": lambda k: 10**5000,
}
_NONE = {"None": lambda k: None}
_FRACTION = {"2.5": lambda k: 2.5}
# Values no bool argument accepts: TypeError.
_NOT_BOOLS = {
    "1": lambda k: 1,
    "0": lambda k: 0,
    "1.0": lambda k: 1.0,
    "str_True": lambda k: "True",
    "None": lambda k: None,
    "nan": lambda k: float("nan"),
    "list": lambda k: [True],
    "array": lambda k: np.array([True, False]),
    "raising_repr": lambda k: RaisingRepr(),
    "huge_repr": lambda k: HugeRepr(),
    "million_element_list": lambda k: [True] * 10**6,
    "dict_5000_deep": lambda k: nested_dict(),
}


def _cases(argument, error, values):
    return [Case(argument, label, make, error)
            for label, make in values.items()]


def number_cases(argument, optional=False):
    """A float argument (None is its default when `optional`)."""
    return (_cases(argument, TypeError, _NOT_NUMBERS)
            + ([] if optional else _cases(argument, TypeError, _NONE))
            + _cases(argument, ValueError, _BAD_NUMBERS))


def count_cases(argument, optional=False):
    """A positive int argument (None is its default when `optional`)."""
    return number_cases(argument, optional) + _cases(argument, TypeError,
                                                     _FRACTION)


def bool_cases(argument):
    return _cases(argument, TypeError, _NOT_BOOLS)


def choice_cases(argument):
    """A string argument taking one of a few values."""
    return (_cases(argument, TypeError, {
        "None": lambda k: None, "1": lambda k: 1, "list": lambda k: ["raise"],
        "million_element_list": lambda k: ["raise"] * 10**6,
        "raising_repr": lambda k: RaisingRepr()})
            + _cases(argument, ValueError, {
                "stop": lambda k: "stop", "empty": lambda k: "",
                "million_char_str": lambda k: "r" * 10**6}))


FIXED_LOSS_SCALE = (number_cases("loss_scale_value")
                    + bool_cases("skip_non_finite"))

DYNAMIC_LOSS_SCALE = (
    number_cases("initial_loss_scale") + count_cases("increment_period")
    + number_cases("multiplier") + number_cases("backoff_factor", True)
    + number_cases("min_loss_scale") + number_cases("max_loss_scale", True)
    + count_cases("hysteresis") + bool_cases("consecutive_hysteresis")
    + choice_cases("on_min_loss_scale")
    + count_cases("max_consecutive_skips", True))

MONITOR = bool_cases("verbose")

# `tf_lossscale.LossScaleOptimizer(inner, **{argument: value})`, or the
# value as the inner optimizer; `k` is the Keras of the inner optimizer.
OPTIMIZER = (
    _cases("inner_optimizer", TypeError, {
        "None": lambda k: None, "str": lambda k: "sgd", "int": lambda k: 3,
        "class": lambda k: k.optimizers.SGD,
        "million_element_list": lambda k: [1.0] * 10**6,
        "dict_5000_deep": lambda k: nested_dict(),
        "raising_repr": lambda k: RaisingRepr(),
        "huge_repr": lambda k: HugeRepr()})
    + _cases("inner_optimizer", ValueError, {
        "keras_own_wrapper": lambda k: k.mixed_precision.LossScaleOptimizer(
            k.optimizers.SGD())})
    # `tf_lossscale.get`'s convention: what is no loss scale identifier is a
    # ValueError; a serialized loss scale of the wrong shape a TypeError.
    + _cases("loss_scale", ValueError, {
        label: make for label, make in {**_NOT_NUMBERS, **_NONE,
                                        **_BAD_NUMBERS}.items()
        if label not in ("dict", "dict_5000_deep")})
    + _cases("loss_scale", ValueError, {
        "dict_5000_deep": lambda k: nested_dict(),
        "unknown_class": lambda k: {"class_name": "Canary", "config": {}}})
    + _cases("loss_scale", TypeError, {
        "class_name_list": lambda k: {"class_name": ["x"], "config": {}},
        "class_name_dict": lambda k: {"class_name": {"x": 1}, "config": {}},
        "config_million_element_list": lambda k: {
            "class_name": "FixedLossScale",
            "config": {"loss_scale_value": [1.0] * 10**6}}})
    + _cases("name", TypeError, {
        "int": lambda k: 3, "bytes": lambda k: b"opt",
        "million_element_list": lambda k: ["x"] * 10**6,
        "raising_repr": lambda k: RaisingRepr()})
    + number_cases("initial_scale", optional=True)
    + count_cases("dynamic_growth_steps", optional=True)
    + _cases("dynamic", TypeError, {
        label: make for label, make in _NOT_BOOLS.items() if label != "None"})
    # Base-optimizer arguments, taken at their defaults only.
    + _cases("clipnorm", ValueError, {
        "array": lambda k: np.array([1.0, 2.0]),
        "million_element_list": lambda k: [1.0] * 10**6,
        "raising_repr": lambda k: RaisingRepr()})
    + _cases("momentum", TypeError, {"0.9": lambda k: 0.9,
                                     "huge_repr": lambda k: HugeRepr()}))


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

"""Argument checks shared by the loss scales and the Keras optimizer.

Every check runs before anything is created, so a rejected argument leaves no
half-built object or stray variable behind. Messages name the argument and
repeat the value that was given.

Conventions: a bool where a number is expected is a TypeError (`True` is an
int to Python, but never a meaningful scale or count); an int argument also
takes a float holding a whole number (`2.0`, as JSON and YAML configs write
it), but not `2.5`.
"""

import math
import numbers

import numpy as np

# A loss scale lives in a float32 variable: a Python float above this limit
# would silently become inf there.
FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)


def _is_bool(value):
    return isinstance(value, (bool, np.bool_))


def finite_float32(name, value, *, above=None, at_least=None, below=None):
    """Returns `value` as a float after checking it fits a float32 variable.

    One lower bound is given: `above` (exclusive) or `at_least` (inclusive);
    `below` (exclusive) is an optional upper bound.

    Raises:
      TypeError: `value` is a bool or not a real number.
      ValueError: `value` is NaN, infinite, larger than float32 allows, or
        outside the bounds.
    """
    # bool is an int subclass, but `FixedLossScale(True)` is a bug, not a scale.
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a Python int or float, got {value!r} "
            f"of type {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # An int beyond any float's range.
        number = math.inf
    if math.isnan(number) or math.isinf(number) or number > FLOAT32_MAX:
        raise ValueError(
            f"{name} must be finite and at most the float32 maximum "
            f"({FLOAT32_MAX:.8g}), got {value!r}")
    # The bounds apply to the value the float32 variable will hold: 1e-46
    # becomes 0 there and 1 + 1e-9 becomes 1.
    stored = float(np.float32(number))
    rounded = "" if stored == number else f" (float32 rounds it to {stored!r})"
    if above is not None and not stored > above:
        raise ValueError(f"{name} must be > {above:g}, got {value!r}{rounded}")
    if at_least is not None and not stored >= at_least:
        raise ValueError(
            f"{name} must be >= {at_least:g}, got {value!r}{rounded}")
    if below is not None and not stored < below:
        raise ValueError(f"{name} must be < {below:g}, got {value!r}{rounded}")
    return number


def positive_int(name, value):
    """Returns `value` as an int after checking it is an int64 >= 1.

    Floats holding a whole number (2.0, `np.float64(3.0)`) are accepted and
    returned as ints.

    Raises:
      TypeError: `value` is a bool, not a real number, or a float with a
        fractional part.
      ValueError: `value` is NaN, infinite, < 1 or beyond int64.
    """
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a positive Python int, got {value!r} "
            f"of type {type(value).__name__}")
    number = value
    if not isinstance(value, numbers.Integral):
        number = float(value)
        if math.isnan(number) or math.isinf(number):
            raise ValueError(
                f"{name} must be a positive int64, got {value!r}")
        if not number.is_integer():
            raise TypeError(
                f"{name} must be a whole number (a positive Python int), "
                f"got {value!r}")
        number = int(number)
    if not 1 <= number <= _INT64_MAX:
        raise ValueError(f"{name} must be a positive int64, got {value!r}")
    return int(number)


def optional_positive_int(name, value):
    """`positive_int`, or None for None."""
    return None if value is None else positive_int(name, value)


def boolean(name, value):
    """Returns `value` as a bool; only `True` and `False` are accepted."""
    if not _is_bool(value):
        raise TypeError(
            f"{name} must be True or False, got {value!r} "
            f"of type {type(value).__name__}")
    return bool(value)


def one_of(name, value, choices):
    """Returns `value` after checking it is one of the strings `choices`."""
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be one of {', '.join(map(repr, choices))}, got "
            f"{value!r} of type {type(value).__name__}")
    if value not in choices:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, choices))}, got "
            f"{value!r}")
    return value

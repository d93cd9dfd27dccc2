"""Argument checks shared by the loss scales and the Keras optimizer.

Every check runs before anything is created, so a rejected argument leaves no
half-built object or stray variable behind. Messages name the argument and
show the value that was given through `summary`: its repr when short, else a
clipped one with its type and length, so a million-element list or a config
nested thousands deep gives a message of a few lines, not megabytes or a
RecursionError.

Conventions: a bool where a number is expected is a TypeError (`True` is an
int to Python, but never a meaningful scale or count); an int argument also
takes a float holding a whole number (`2.0`, as JSON and YAML configs write
it), but not `2.5`.
"""

import math
import numbers
import reprlib

import numpy as np

class DoubleScalingError(TypeError, ValueError):
    """An optimizer that already scales the loss was given to a wrapper:
    wrapping it would scale the loss twice.

    Every wrapper raises it (Keras 3, tf-keras and TF1). It is a TypeError,
    as tf-keras' own wrapper raises, and a ValueError, as TensorFlow's TF1
    wrapper and tf_lossscale before 0.4 raised, so code written against
    either keeps catching it.
    """


class ReplicaContextError(ValueError, RuntimeError):
    """A wrapper's `apply_gradients` (or Keras 3's `apply`) was called in a
    strategy's cross-replica context, where one call cannot stand for every
    replica's step.

    Every wrapper raises it (Keras 3, tf-keras and TF1). It is a ValueError,
    as TensorFlow's and Keras' own wrappers raise, and a RuntimeError, as
    tf_lossscale's Keras wrappers raised before 0.4, so code written against
    either keeps catching it.
    """


# A loss scale lives in a float32 variable: a Python float above this limit
# would silently become inf there.
FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)

# The longest rendering of a value in a message; a repr up to this long is
# shown whole (DynamicLossScale's default repr fits).
SUMMARY_CHARS = 160
# Ints beyond this many bits (about 150 digits) are described, not written
# out: Python refuses to write ints of more than 4300 digits.
_MAX_INT_BITS = 500


class _ShortRepr(reprlib.Repr):
    """`reprlib`'s bounded repr (a few items per container, a few levels
    deep; an object whose repr raises gets a placeholder), with huge ints
    described by their size."""

    def __init__(self):
        super().__init__()
        self.maxlevel = 3
        self.maxdict = 4
        self.maxlist = self.maxtuple = self.maxset = 6
        self.maxfrozenset = self.maxdeque = self.maxarray = 6
        self.maxstring = 60
        self.maxlong = self.maxother = SUMMARY_CHARS

    def repr_int(self, x, level):
        if x.bit_length() > _MAX_INT_BITS:
            sign = "-" if x < 0 else ""
            return f"<{sign}int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()


def summary(value):
    """`value` rendered for an error message, in at most ~200 characters.

    Its repr when that is short and complete; otherwise a clipped repr
    followed by its type and, for a container, its length:
    `[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, ...] (list of length 1000000)`. Never
    raises, and never renders more than a few items or levels of a value.
    """
    try:
        text = _SHORT_REPR.repr(value)
    except Exception:  # pylint: disable=broad-except
        # reprlib guards objects' own reprs; this guards the rest (a str or
        # list subclass that fails while being sliced, say).
        return f"<a {type(value).__name__} that cannot be shown>"
    clipped = len(text) > SUMMARY_CHARS
    if clipped:
        text = text[:SUMMARY_CHARS - 3] + "..."
    if not clipped and "..." not in text:
        return text
    return f"{text} ({_kind(value)})"


def _kind(value):
    """`value`'s type name, with its length when it has one."""
    kind = type(value).__name__
    try:
        size = len(value)
    except Exception:  # pylint: disable=broad-except
        # No length, or a hostile __len__: the type alone will do.
        return kind
    return f"{kind} of length {size}"


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
            f"{name} must be a Python int or float, got {summary(value)} "
            f"of type {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # An int beyond any float's range.
        number = math.inf
    if math.isnan(number) or math.isinf(number) or number > FLOAT32_MAX:
        raise ValueError(
            f"{name} must be finite and at most the float32 maximum "
            f"({FLOAT32_MAX:.8g}), got {summary(value)}")
    # The bounds apply to the value the float32 variable will hold: 1e-46
    # becomes 0 there and 1 + 1e-9 becomes 1.
    stored = float(np.float32(number))
    rounded = "" if stored == number else f" (float32 rounds it to {stored!r})"
    if above is not None and not stored > above:
        raise ValueError(
            f"{name} must be > {above:g}, got {summary(value)}{rounded}")
    if at_least is not None and not stored >= at_least:
        raise ValueError(
            f"{name} must be >= {at_least:g}, got {summary(value)}{rounded}")
    if below is not None and not stored < below:
        raise ValueError(
            f"{name} must be < {below:g}, got {summary(value)}{rounded}")
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
            f"{name} must be a positive Python int, got {summary(value)} "
            f"of type {type(value).__name__}")
    number = value
    if not isinstance(value, numbers.Integral):
        number = float(value)
        if math.isnan(number) or math.isinf(number):
            raise ValueError(
                f"{name} must be a positive int64, got {summary(value)}")
        if not number.is_integer():
            raise TypeError(
                f"{name} must be a whole number (a positive Python int), "
                f"got {summary(value)}")
        number = int(number)
    if not 1 <= number <= _INT64_MAX:
        raise ValueError(
            f"{name} must be a positive int64, got {summary(value)}")
    return int(number)


def optional_positive_int(name, value):
    """`positive_int`, or None for None."""
    return None if value is None else positive_int(name, value)


def boolean(name, value):
    """Returns `value` as a bool; only `True` and `False` are accepted."""
    if not _is_bool(value):
        raise TypeError(
            f"{name} must be True or False, got {summary(value)} "
            f"of type {type(value).__name__}")
    return bool(value)


def one_of(name, value, choices):
    """Returns `value` after checking it is one of the strings `choices`."""
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be one of {', '.join(map(repr, choices))}, got "
            f"{summary(value)} of type {type(value).__name__}")
    if value not in choices:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, choices))}, got "
            f"{summary(value)}")
    return value

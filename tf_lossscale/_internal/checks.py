"""Argument checks for every entry point (run before anything changes, and
adding no op to a step), the package's two exceptions and its warning about
a shared loss scale."""

import collections.abc
import math
import numbers
import operator
import os
import reprlib
import sys

import numpy as np
import tensorflow as tf

from tf_lossscale._internal import private_api


class DoubleScalingError(TypeError, ValueError):
    """A wrapper was given an optimizer that already scales the loss (a
    TypeError as in tf-keras, a ValueError as in TensorFlow's TF1 wrapper)."""


class ReplicaContextError(ValueError, RuntimeError):
    """A wrapper's step was called in a strategy's cross-replica context: a
    ValueError as TensorFlow's wrappers raise, a RuntimeError as ours did."""


class SharedLossScaleWarning(UserWarning):
    """Two optimizer wrappers hold one stateful loss scale without a
    `LossScaleGroup`: it moves once per optimizer step, not per iteration."""


def user_stacklevel():
    """The `warnings.warn` stacklevel, for the caller, of the user's line."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
    while frame is not None and os.path.abspath(
            frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


# A loss scale lives in a float32 variable: a larger float would become inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)
# The longest rendering of a value; a repr up to this long is shown whole.
SUMMARY_CHARS = 160
_FLOATING = "float16, bfloat16, float32 or float64"
_NO_VARIABLE = object()  # A gradient checked alone.


class _ShortRepr(reprlib.Repr):
    """A few items and levels; an int too long to write, by its size."""

    def repr_int(self, x, level):
        if x.bit_length() > 500:
            return f"<{'-' if x < 0 else ''}int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT_REPR = _ShortRepr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring = 3, 60
_SHORT_REPR.maxlong = _SHORT_REPR.maxother = SUMMARY_CHARS


def summary(value):
    """`value`'s repr in at most ~200 characters (clipped: with its type and
    length)."""
    try:
        text = _SHORT_REPR.repr(value)
    except Exception:  # pylint: disable=broad-except  # A hostile subclass.
        return f"<a {type(value).__name__} that cannot be shown>"
    if len(text) <= SUMMARY_CHARS and "..." not in text:
        return text
    if len(text) > SUMMARY_CHARS:
        text = text[:SUMMARY_CHARS - 3] + "..."
    try:
        return f"{text} ({type(value).__name__} of length {len(value)})"
    except Exception:  # pylint: disable=broad-except
        return f"{text} ({type(value).__name__})"  # No (sane) length.


def of_type(name, value, types, expected):
    """Returns `value`, if of `types` (`expected` names them); a bool is no
    `numbers.Real`: never a scale or a count."""
    if not isinstance(value, types) or types is numbers.Real and isinstance(
            value, (bool, np.bool_)):
        raise _wrong_type(name, value, expected)
    return value


def _wrong_type(name, value, expected):
    return TypeError(f"{name} must be {expected}, got {summary(value)} of "
                     f"type {type(value).__name__}")


def finite_float32(name, value, *, above=None, at_least=None, below=None,
                   at_most=None):
    """`value` as a float a float32 variable holds, within the bounds."""
    of_type(name, value, numbers.Real, "a Python int or float")
    try:
        number = float(value)
    except OverflowError:  # An int beyond any float's range.
        number = math.inf
    if not math.isfinite(number) or number > FLOAT32_MAX:
        raise ValueError(f"{name} must be finite and at most the float32 "
                         f"maximum ({FLOAT32_MAX:.8g}), got {summary(value)}")
    # Bounds apply to what the variable holds: 1e-46 becomes 0 there.
    stored = float(np.float32(number))
    rounded = "" if stored == number else f" (float32 rounds it to {stored!r})"
    for sign, bound, holds in (
            (">", above, operator.gt), (">=", at_least, operator.ge),
            ("<", below, operator.lt), ("<=", at_most, operator.le)):
        if bound is not None and not holds(stored, bound):
            raise ValueError(f"{name} must be {sign} {bound:g}, got "
                             f"{summary(value)}{rounded}")
    return number


def positive_int(name, value):
    """`value` as an int64 >= 1; a fraction is a TypeError."""
    of_type(name, value, numbers.Real, "a positive Python int")
    number = value
    if not isinstance(value, numbers.Integral):
        number = float(value)
        if math.isfinite(number) and not number.is_integer():
            raise TypeError(f"{name} must be a whole number (a positive "
                            f"Python int), got {summary(value)}")
        number = int(number) if math.isfinite(number) else 0
    if not 1 <= number <= _INT64_MAX:
        raise ValueError(f"{name} must be a positive int64, got "
                         f"{summary(value)}")
    return int(number)


def optional_positive_int(name, value):
    """`positive_int`, or None for None."""
    return None if value is None else positive_int(name, value)


def boolean(name, value):
    """Returns `value` as a bool; only `True` and `False` are taken."""
    return bool(of_type(name, value, (bool, np.bool_), "True or False"))


def one_of(name, value, choices):
    """Returns `value` after checking it is one of the strings `choices`."""
    expected = f"one of {', '.join(map(repr, choices))}"
    if of_type(name, value, str, expected) not in choices:
        raise ValueError(f"{name} must be {expected}, got {summary(value)}")
    return value


def inner_optimizer(value, optimizer_types, wrapper_types, expected, *,
                    argument="inner_optimizer", error=TypeError):
    """Raises unless `value` is an unwrapped optimizer of `optimizer_types`
    (`expected` names them), not of `wrapper_types`; in tf-keras' words."""
    if isinstance(value, wrapper_types):
        raise DoubleScalingError(
            "LossScaleOptimizer cannot wrap another LossScaleOptimizer, but "
            f"got: {summary(value)} as {argument}, which is already a "
            "LossScaleOptimizer: the loss would be scaled twice")
    if not isinstance(value, optimizer_types):
        raise error(f'"{argument}" must be an instance of {expected}, but '
                    f"got: {summary(value)} of type {type(value).__name__}")
    if getattr(value, private_api.TF_KERAS_WRAPPED, False):
        raise ValueError(
            f'"{argument}" is already wrapped by a LossScaleOptimizer. An '
            "optimizer can only be wrapped by a single LossScaleOptimizer: "
            "both would apply their updates to the same weights "
            f"({summary(getattr(value, 'name', value))} is already wrapped)")


def optimizer_config(config, custom_objects, optimizer_types=()):
    """`(inner, kwargs)` of a wrapper's config (TF 2.1-2.3: `optimizer`);
    `inner` is serialized or of `optimizer_types`."""
    of_type("custom_objects", custom_objects,
            (collections.abc.Mapping, type(None)), "a dict of names to classes")
    if not isinstance(config, dict) or any(
            not isinstance(key, str) for key in config):
        raise _wrong_type("A LossScaleOptimizer config", config,
                          "a dict with string keys (argument names)")
    key = "inner_optimizer" if "inner_optimizer" in config else "optimizer"
    if key not in config:
        raise ValueError("A LossScaleOptimizer config needs 'inner_optimizer' "
                         "(or 'optimizer'), got keys "
                         f"{summary(sorted(config))}")
    inner = config[key]
    if not (isinstance(inner, optimizer_types) or isinstance(inner, dict)
            and isinstance(inner.get("class_name"), str)
            and isinstance(inner.get("config", {}), (dict, type(None)))):
        raise TypeError(f"A LossScaleOptimizer config's {key!r} must be a "
                        "serialized optimizer, a dict like {'class_name': "
                        f"'Adam', 'config': {{...}}}}, got {summary(inner)}")
    return inner, {k: v for k, v in config.items() if k != key}


def replica_context():
    """Raises ReplicaContextError in a strategy's cross-replica context."""
    if tf.distribute.has_strategy() and (
            tf.distribute.in_cross_replica_context()):
        raise ReplicaContextError(
            "LossScaleOptimizer.apply_gradients must be called in a replica "
            "context (strategy.run, model.fit), not under strategy.scope()")


def pairs(grads_and_vars):
    """`(grads, variables)`, two lists to check with `gradients`."""
    listed = _as_list("grads_and_vars", grads_and_vars,
                      "a list of (gradient, variable) pairs")
    for index, pair in enumerate(listed):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"grads_and_vars[{index}] must be a (gradient, "
                            f"variable) pair, got {summary(pair)}")
    return [grad for grad, _ in listed], [var for _, var in listed]


def gradients(grads, variables=None):
    """`grads` as a list: one per variable, None or floating-point of a
    fitting shape, not all None; without `variables`, flattened `grads`."""
    if variables is None:
        return [_gradient(i, grad, _NO_VARIABLE) for i, grad in enumerate(
            tf.nest.flatten(grads))]
    grads = _as_list("grads", grads, "a list of gradients, one per variable")
    if not variables:
        raise ValueError("No variables given: a step needs one (gradient, "
                         "variable) pair per variable to update")
    if len(grads) != len(variables):
        raise ValueError(
            f"Got {len(grads)} gradients for {len(variables)} variables: "
            "give one gradient (or None) per variable, in the same order")
    checked = [_gradient(index, grad, variable)
               for index, (grad, variable) in enumerate(zip(grads, variables))]
    if all(grad is None for grad in checked):
        raise ValueError("No gradients provided for any variable: all are "
                         f"None, for {summary([_name(v) for v in variables])}")
    return checked


def loss(value):
    """Returns `value` as a tensor after checking it is floating-point."""
    try:
        value = tf.convert_to_tensor(value)
    except (TypeError, ValueError, RecursionError):
        raise TypeError("loss must be a floating-point tensor, got "
                        f"{summary(value)}") from None
    if not value.dtype.is_floating:
        raise TypeError(f"loss must be a floating-point tensor ({_FLOATING}),"
                        f" got dtype {value.dtype.name}")
    return value


def _as_list(name, values, expected):
    """`values` as a list; a tensor, array, string or dict is refused."""
    if hasattr(values, "dtype") or isinstance(values, (
            str, bytes, collections.abc.Mapping)) or not isinstance(
                values, collections.abc.Iterable):
        raise _wrong_type(name, values, expected)
    return list(values)


def _gradient(index, grad, variable):
    """`grad` as a tensor, IndexedSlices or None, checked (for `variable`)."""
    def which():  # A summary costs more than the check: made on refusal.
        if variable is _NO_VARIABLE:
            return f"gradient {index}"
        return f"gradient {index} (for variable {summary(_name(variable))})"

    # On the class: a Keras variable computes `dtype` and `shape` per read.
    kind = type(variable)
    if variable is not _NO_VARIABLE and not (hasattr(kind, "assign") and (
            hasattr(kind, "dtype") and hasattr(kind, "shape"))):
        raise _wrong_type(f"variable {index}", variable,
                          "a tf.Variable or keras.Variable")
    if grad is None:
        return None
    if not isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
        try:
            grad = tf.convert_to_tensor(grad)
        except (TypeError, ValueError, RecursionError):
            raise _wrong_type(which(), grad, "a tensor") from None
    if not grad.dtype.is_floating:
        raise TypeError(f"{which()} has dtype {grad.dtype.name}; gradients "
                        f"must be floating-point ({_FLOATING})")
    if variable is _NO_VARIABLE:
        return grad
    # A TensorShape for TensorFlow and Keras 3 variables (a tuple otherwise).
    shape, expected = grad.shape, tf.TensorShape(variable.shape)
    if isinstance(grad, tf.IndexedSlices):  # Rows: the trailing dimensions.
        shape, expected = grad.values.shape[1:], expected[1:]
    if not shape.is_compatible_with(expected):
        raise ValueError(f"{which()} has shape {shape}, which does not fit "
                         f"the variable's {expected}")
    return grad


def _name(variable):  # A Keras 3 variable's path, or a TensorFlow name.
    return getattr(variable, "path", None) or getattr(variable, "name", None)

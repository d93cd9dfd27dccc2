"""What a step's loss, gradients and variables must be, checked up front.

Every optimizer wrapper (Keras 3's and tf-keras' `LossScaleOptimizer`, the
TF1 `MixedPrecisionLossScaleOptimizer`) passes a step's arguments through
here before anything else, so all of them refuse the same inputs with the
same exceptions, and a refused call changes nothing: not the loss scale, the
weights, the slots or any counter.

* `grads_and_vars`: an iterable of `(gradient, variable)` pairs;
* gradients and variables come one for one (Keras 3's `apply(grads,
  variables)` takes them as two lists), and there is at least one;
* each variable is a variable (it has `assign`, `dtype` and `shape`);
* each gradient is None, a `tf.IndexedSlices` or something that converts to
  a tensor, of a floating-point dtype, with a static shape that fits its
  variable's (for `tf.IndexedSlices`, the rows');
* at least one gradient is not None;
* a loss to scale is a floating-point tensor (or converts to one).

A `TypeError` says a value is of the wrong kind, a `ValueError` that it does
not fit the rest; both name the position and the variable, and summarise the
value (`tf_lossscale._internal.checks.summary`). The checks read only what Python
knows without running anything (lengths, static dtypes and shapes): eagerly
they run on every call, in a `tf.function` once, while it is traced, and
they add no op to the step.
"""

import collections.abc

import tensorflow as tf

from tf_lossscale._internal import checks

_FLOATING = "float16, bfloat16, float32 or float64"


def split_pairs(grads_and_vars):
    """Returns `(grads, variables)`, two lists, from the pairs
    `grads_and_vars`; `check` them next.

    Raises:
      TypeError: `grads_and_vars` is not an iterable of pairs.
    """
    pairs = _as_list("grads_and_vars", grads_and_vars,
                     "a list of (gradient, variable) pairs")
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(
                f"grads_and_vars[{index}] must be a (gradient, variable) "
                f"pair, got {checks.summary(pair)}")
    return [grad for grad, _ in pairs], [variable for _, variable in pairs]


def checked_pairs(grads_and_vars):
    """`split_pairs`, then `check`: `(grads, variables)`, both checked.

    Raises:
      TypeError, ValueError: as `split_pairs` and `check`.
    """
    grads, variables = split_pairs(grads_and_vars)
    return check(grads, variables), variables


def check(grads, variables):
    """Returns `grads` as a list of tensors, `tf.IndexedSlices` and None,
    after checking them against `variables` (a list).

    Raises:
      TypeError: `grads` is not a list-like of gradients, a variable is not
        a variable, or a gradient is not a tensor of a floating-point dtype.
      ValueError: there are no variables, not one gradient per variable,
        a gradient's static shape does not fit its variable's, or every
        gradient is None.
    """
    grads = _as_list("grads", grads, "a list of gradients, one per variable")
    if not variables:
        raise ValueError(
            "No variables given: a step needs one (gradient, variable) pair "
            "per variable to update")
    if len(grads) != len(variables):
        raise ValueError(
            f"Got {len(grads)} gradients for {len(variables)} variables: "
            "give one gradient (or None) per variable, in the same order")
    checked = []
    for index, (grad, variable) in enumerate(zip(grads, variables)):
        _check_variable(index, variable)
        checked.append(_checked_gradient(index, grad, variable))
    if all(grad is None for grad in checked):
        names = [_name(variable) for variable in variables]
        raise ValueError(
            "No gradients provided for any variable: all are None, for "
            f"{checks.summary(names)}")
    return checked


def check_structure(grads):
    """Checks each gradient in the nested structure `grads` as `check`
    does, without variables; positions count in `tf.nest.flatten` order.

    Raises:
      TypeError: a gradient is not a tensor of a floating-point dtype.
    """
    for index, grad in enumerate(tf.nest.flatten(grads)):
        _checked_gradient(index, grad)


def checked_loss(loss):
    """Returns `loss` as a tensor after checking it is floating-point.

    Raises:
      TypeError: `loss` does not convert to a tensor, or is not of a
        floating-point dtype (its gradients would be None or wrong).
    """
    try:
        loss = tf.convert_to_tensor(loss)
    except (TypeError, ValueError):
        raise TypeError(
            "loss must be a floating-point tensor, got "
            f"{checks.summary(loss)}") from None
    if not loss.dtype.is_floating:
        raise TypeError(
            f"loss must be a floating-point tensor ({_FLOATING}), got dtype "
            f"{loss.dtype.name}")
    return loss


def _as_list(name, values, expected):
    """`values` as a list; a tensor, array, string or dict is refused, not
    split into its elements, characters or keys."""
    if (hasattr(values, "dtype") or isinstance(values, (str, bytes))
            or isinstance(values, collections.abc.Mapping)
            or not isinstance(values, collections.abc.Iterable)):
        raise TypeError(
            f"{name} must be {expected}, got {checks.summary(values)} "
            f"of type {type(values).__name__}")
    return list(values)


def _check_variable(index, variable):
    # Looked up on the class: a Keras variable computes `dtype` and `shape`
    # each time they are read, which costs more than the whole check.
    kind = type(variable)
    if not (hasattr(kind, "assign") and hasattr(kind, "dtype")
            and hasattr(kind, "shape")):
        raise TypeError(
            f"variable {index} must be a tf.Variable or keras.Variable, got "
            f"{checks.summary(variable)} of type "
            f"{type(variable).__name__}")


def _checked_gradient(index, grad, variable=None):
    """`grad` as a tensor (or IndexedSlices, or None) after its checks."""
    if grad is None:
        return None
    if not isinstance(grad, (tf.Tensor, tf.IndexedSlices)):
        try:
            grad = tf.convert_to_tensor(grad)
        except (TypeError, ValueError):
            raise TypeError(
                f"{_which(index, variable)} must be a tensor, got "
                f"{checks.summary(grad)} of type "
                f"{type(grad).__name__}") from None
    if not grad.dtype.is_floating:
        raise TypeError(
            f"{_which(index, variable)} has dtype {grad.dtype.name}; "
            f"gradients must be floating-point ({_FLOATING})")
    if variable is not None:
        _check_shape(index, grad, variable)
    return grad


def _check_shape(index, grad, variable):
    # A TensorShape for TensorFlow and Keras 3 variables (a tuple otherwise).
    expected = tf.TensorShape(variable.shape)
    shape = grad.shape
    if isinstance(grad, tf.IndexedSlices):
        # Rows of the variable: only the trailing dimensions are known.
        shape, expected = grad.values.shape[1:], expected[1:]
    if not shape.is_compatible_with(expected):
        raise ValueError(
            f"{_which(index, variable)} has shape {shape}, which does not "
            f"fit the variable's {expected}")


def _which(index, variable):
    if variable is None:
        return f"gradient {index}"
    name = checks.summary(_name(variable))
    return f"gradient {index} (for variable {name})"


def _name(variable):
    """A Keras 3 variable's path, or a TensorFlow variable's name."""
    return getattr(variable, "path", None) or getattr(variable, "name", None)

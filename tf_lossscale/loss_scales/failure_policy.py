"""What a `DynamicLossScale` refuses and how it fails: the state check, the
failure policy, and their messages.

The state check runs before a step moves the state; a state outside its
bounds (a damaged file, a hand assignment) refuses the step and changes
nothing. A stored value an int64 variable cannot hold exactly is refused
when a file is loaded (`check_loadable`). The failure policy runs after the
state has moved. Eagerly they raise or print at once, in graphs they are
ops; under XLA the host acts (`xla_record`, `xla_checks`).
"""

import sys

import numpy as np
import tensorflow as tf

POLICIES = ("continue", "warn", "raise")
WARNING_PREFIX = "tf_lossscale WARNING:"

# The state variables, in their saved order (H and C only when tracked).
FIELDS = ("current_loss_scale", "good_steps", "hysteresis_remaining",
          "consecutive_skips")

_FLOAT32_INF_BITS = 0x7F800000
_INT64_MIN, _INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max

NOT_WATCHED = (
    "tf_lossscale: this training step is compiled with XLA (jit_compile) and "
    "its DynamicLossScale asks for errors or warnings ({asks}). A compiled "
    "step can neither fail nor print, so they are carried out on the host "
    "after each call, and nothing is watching this step. Fix one of: pass "
    "tf_lossscale.XlaChecks() (or a tf_lossscale.LossScaleMonitor()) in "
    "model.fit's callbacks; wrap a custom step, or model.train_on_batch, as "
    "step = tf_lossscale.with_xla_checks(step, optimizer), after compiling "
    "the model again or making the tf.function again (TensorFlow may not "
    "trace a function whose first trace failed); or turn XLA off "
    "(jit_compile=False).")


def needs_host(policy, limit):
    """Whether a policy asks for failures or warnings (the host's, under
    XLA): "warn", "raise" or a `max_consecutive_skips`."""
    return policy != "continue" or limit is not None


def what_is_asked(policy, limit):
    """The settings that ask for failures, for messages."""
    asks = [] if policy == "continue" else [f"on_min_loss_scale={policy!r}"]
    if limit is not None:
        asks.append(f"max_consecutive_skips={limit}")
    return ", ".join(asks)


# ---------------------------------------------------------------------------
# The state check.


def _invalid_state_prefix(names, hysteresis):
    rules = {"current_loss_scale": "finite and > 0", "good_steps": ">= 0",
             "hysteresis_remaining": f"in [0, {hysteresis}]",
             "consecutive_skips": ">= 0"}
    bounds = ", ".join(f"{name} {rules[name]}" for name in names)
    return ("tf_lossscale: DynamicLossScale holds a state that cannot be "
            "right (restored from a checkpoint or file, or assigned?): it "
            f"must have {bounds}; no variable was changed. Got")


def invalid_state_message(values, hysteresis):
    """The message of a refused state; `values` maps the names of the
    tracked state variables, in `FIELDS` order, to their values."""
    got = ", ".join(
        f"{name}={float(value)!r}" if name == FIELDS[0]
        else f"{name}={int(value)}" for name, value in values.items())
    return f"{_invalid_state_prefix(values, hysteresis)} {got}"


def state_is_valid(state, hysteresis):
    """A bool tensor: the `DynamicState` `state` is within the bounds."""
    # On the bits: CPUs that flush subnormals to zero would call a valid
    # subnormal scale "not > 0". Finite positive float32 values are exactly
    # the bit patterns strictly between +0 and +inf.
    bits = tf.bitcast(state.scale, tf.int32)
    checks = [bits > 0, bits < _FLOAT32_INF_BITS, state.good_steps >= 0]
    if state.hysteresis_remaining is not None:
        budget = state.hysteresis_remaining
        checks += [budget >= 0, budget <= hysteresis]
    if state.consecutive_skips is not None:
        checks.append(state.consecutive_skips >= 0)
    return tf.reduce_all(tf.stack(checks))


def check_state(state, hysteresis):
    """Fails, changing nothing, unless `state` is within the bounds.

    Eagerly it raises InvalidArgumentError; in graphs it returns the
    assertion op. A few scalar ops per step and no formatting op.
    """
    valid = state_is_valid(state, hysteresis)
    named = {name: value for name, value in zip(FIELDS, state)
             if value is not None}
    if tf.executing_eagerly():
        if not bool(valid):
            raise tf.errors.InvalidArgumentError(
                None, None, invalid_state_message(
                    {k: v.numpy() for k, v in named.items()}, hysteresis))
        return None
    data = [_invalid_state_prefix(named, hysteresis)]
    for name, value in named.items():
        data += [f"{name} =", value]
    return tf.debugging.Assert(valid, data)


def check_loadable(stored):
    """Raises unless every value can be assigned exactly to its variable.

    For `.keras` and `.h5` stores, before any variable is assigned: a value
    of another shape, of a non-numeric kind, or (for int64 variables) one
    that is not a whole number in the int64 range is refused. The value's
    range is not checked here: the state check refuses it at the first step.

    Args:
      stored: `((name, variable), value)` pairs of the loss scale's state.

    Raises:
      TypeError: a value is not numeric.
      ValueError: a value has another shape, or an int64 variable cannot
        hold it exactly.
    """
    for (name, variable), stored_value in stored:
        value = np.asarray(stored_value)
        got = (f"{value.reshape(()).item()!r} ({value.dtype})"
               if value.size == 1 else
               f"an array of shape {value.shape} and dtype {value.dtype}")
        where = (f"tf_lossscale: the loss scale's {name} in this file "
                 f"cannot be loaded: got {got}")
        if value.dtype.kind not in "iuf":
            raise TypeError(f"{where}; it must be a number. Nothing was "
                            "loaded.")
        if value.shape != tuple(variable.shape):
            raise ValueError(f"{where}; its shape must be "
                             f"{tuple(variable.shape)}. Nothing was loaded.")
        if variable.dtype == tf.int64 and not _exact_int64(value):
            raise ValueError(f"{where}; it must be a whole number an int64 "
                             "holds exactly. Nothing was loaded.")


def _exact_int64(value):
    if value.dtype.kind in "iu":
        return bool(np.all((value >= _INT64_MIN) & (value <= _INT64_MAX)))
    with np.errstate(invalid="ignore"):
        # 2**63 itself is a float64 but no int64.
        return bool(np.all(np.isfinite(value) & (value == np.round(value))
                           & (value >= -2.0**63) & (value < 2.0**63)))


# ---------------------------------------------------------------------------
# The failure policy.


def floor_template(floor, policy):
    """The message of a back-off due at the floor; `{}`: scale, skips."""
    if policy == "warn":
        return (f"{WARNING_PREFIX} a loss scale back-off was due but the "
                f"scale is already at min_loss_scale={floor!r} (current "
                "scale {}); steps skipped in a row for non-finite gradients: "
                "{}")
    return ("tf_lossscale: a loss scale back-off was due but the scale "
            f"is already at min_loss_scale={floor!r} (current scale {{}}); "
            "steps skipped in a row for non-finite gradients: {} "
            "(on_min_loss_scale=raise). The gradients overflow even at "
            "the smallest scale allowed: look for NaN/Inf in the data or "
            "the model, or lower min_loss_scale.")


def limit_template(limit):
    """The message of `max_consecutive_skips`; `{}`: skips, scale."""
    return ("tf_lossscale: steps skipped in a row for non-finite "
            f"gradients: {{}}, the limit set by max_consecutive_skips="
            f"{limit}; current loss scale {{}}.")


def apply_policy(new_state, at_floor, floor, policy, limit):
    """The warning or failures due after a step (not under XLA): the ops to
    wait on in graphs; eagerly they have raised or printed already."""
    scale, skips = new_state.scale, new_state.consecutive_skips
    ops = []
    if policy != "continue":
        act = _warn_if if policy == "warn" else fail_if
        ops += ops_of(act(at_floor, floor_template(floor, policy),
                          (scale, skips)))
    if limit is not None:
        with tf.control_dependencies(ops):
            ops += ops_of(fail_if(skips >= limit, limit_template(limit),
                                   (skips, scale)))
    return ops


def ops_of(op):
    """[op] for an op or tensor, [] for None (eagerly, nothing to wait on)."""
    return [] if op is None else [op]


def fail_if(condition, template, values):
    """Fails the step with `template` formatted with `values` if `condition`.

    Eagerly it raises; in graphs it returns the assertion op.
    """
    if tf.executing_eagerly():
        if bool(condition):
            raise tf.errors.InvalidArgumentError(None, None, tf.strings.format(
                template, values).numpy().decode())
        return None
    return tf.debugging.Assert(
        tf.logical_not(condition), [tf.strings.format(template, values)])


def _warn_if(condition, template, values):
    """Prints `template` formatted with `values` to stderr if `condition`.

    tf.print, not Python logging: it prints from inside graphs too, every
    time the step runs, whatever TF_CPP_MIN_LOG_LEVEL says. Eagerly it has
    printed when it returns.
    """

    def warn():
        with tf.control_dependencies([tf.print(
                tf.strings.format(template, values),
                output_stream=sys.stderr)]):
            return tf.constant(True)

    return tf.cond(condition, warn, lambda: tf.constant(False))


def format_like_the_step(template, values):
    """`template` formatted on the host exactly as the step formats it:
    `values` are (value, dtype) pairs."""
    tensors = [tf.constant(value, dtype) for value, dtype in values]
    return tf.strings.format(template, tensors).numpy().decode()

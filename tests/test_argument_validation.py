"""Bad constructor arguments fail loudly, say why, and create nothing.

TensorFlow's reference loss scales accept several of these values and then
misbehave (a scale of 0 or NaN, a multiplier of 1 that never grows); this
library refuses them up front.
"""

import contextlib
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

_NAN = float("nan")
_INF = float("inf")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_ABOVE_FLOAT32_MAX = 3.5e38


@contextlib.contextmanager
def _counting_variable_creations():
    created = []

    def creator(next_creator, **kwargs):
        created.append(kwargs.get("name"))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield created


def _assert_rejected(make, error, name, value):
    """`make()` raises `error` naming `name` and `value`, creating nothing."""
    with _counting_variable_creations() as created:
        with pytest.raises(error) as raised:
            make()
    message = str(raised.value)
    assert re.search(rf"\b{name}\b", message), message
    assert repr(value) in message or str(value) in message, message
    assert not created


def _assert_nothing_in_tf1_graph(make, error):
    with tf.Graph().as_default():
        with pytest.raises(error):
            make()
        assert not tf.compat.v1.global_variables()


_FIXED_VALUE_ERRORS = [0, 0.5, 0.999, -1, _NAN, _INF, -_INF,
                       _ABOVE_FLOAT32_MAX, 10**40, np.float64(_NAN)]
_FIXED_TYPE_ERRORS = [True, False, np.bool_(True), "2", None, [2.0],
                      tf.constant(2.0), 2 + 0j]


@pytest.mark.parametrize("value", _FIXED_VALUE_ERRORS, ids=repr)
def test_fixed_rejects_out_of_range_value(value):
    _assert_rejected(lambda: tf_lossscale.FixedLossScale(value), ValueError,
                     "loss_scale_value", value)


@pytest.mark.parametrize("value", _FIXED_TYPE_ERRORS, ids=repr)
def test_fixed_rejects_non_number(value):
    _assert_rejected(lambda: tf_lossscale.FixedLossScale(value), TypeError,
                     "loss_scale_value", value)


def test_fixed_rejects_int_too_large_for_any_float():
    # Larger than any Python float, so a naive float() overflows.
    value = 10**400
    with pytest.raises(ValueError, match="loss_scale_value"):
        tf_lossscale.FixedLossScale(value)


@pytest.mark.parametrize("value", [1, 1.0, np.float32(1.5), _FLOAT32_MAX],
                         ids=repr)
def test_fixed_accepts_boundary_values(value):
    loss_scale = tf_lossscale.FixedLossScale(value)
    assert loss_scale().numpy() == np.float32(value)


def _dynamic(**kwargs):
    return lambda: tf_lossscale.DynamicLossScale(**kwargs)


_DYNAMIC_VALUE_ERRORS = [
    # 1e-46 is positive but the float32 variable would hold 0.
    ("initial_loss_scale", value)
    for value in [0, 0.0, -1, -0.5, _NAN, _INF, -_INF, _ABOVE_FLOAT32_MAX,
                  1e-46]
] + [
    ("increment_period", value) for value in [0, -1, -2000, 2**63]
] + [
    # 1 + 1e-9 is above 1 but rounds to 1.0 in float32: it would never grow.
    ("multiplier", value) for value in [1, 1.0, 0.5, 0, -2, _NAN, _INF,
                                        _ABOVE_FLOAT32_MAX, 1 + 1e-9]
]
_DYNAMIC_TYPE_ERRORS = [
    ("initial_loss_scale", value)
    for value in [True, False, "1024", None, tf.constant(2.0), [2.0]]
] + [
    ("increment_period", value)
    for value in [2.5, 2.0, "3", True, None, np.float64(3.0),
                  tf.constant(3)]
] + [
    ("multiplier", value) for value in [True, "2", None, tf.constant(2.0)]
]


def _ids(cases):
    return [f"{name}={value!r}" for name, value in cases]


@pytest.mark.parametrize("name, value", _DYNAMIC_VALUE_ERRORS,
                         ids=_ids(_DYNAMIC_VALUE_ERRORS))
def test_dynamic_rejects_out_of_range_argument(name, value):
    _assert_rejected(_dynamic(**{name: value}), ValueError, name, value)


@pytest.mark.parametrize("name, value", _DYNAMIC_TYPE_ERRORS,
                         ids=_ids(_DYNAMIC_TYPE_ERRORS))
def test_dynamic_rejects_argument_of_wrong_type(name, value):
    _assert_rejected(_dynamic(**{name: value}), TypeError, name, value)


@pytest.mark.parametrize("name", ["initial_loss_scale", "multiplier"])
def test_dynamic_rejects_int_too_large_for_any_float(name):
    with pytest.raises(ValueError, match=name):
        tf_lossscale.DynamicLossScale(**{name: 10**400})


@pytest.mark.parametrize("make, error", [
    (_dynamic(initial_loss_scale=0), ValueError),
    (_dynamic(increment_period=2.5), TypeError),
    (_dynamic(multiplier=_NAN), ValueError),
    # A valid argument before a bad one must not leave its variable behind.
    (_dynamic(initial_loss_scale=8, increment_period=1, multiplier=1),
     ValueError),
    (lambda: tf_lossscale.FixedLossScale(True), TypeError),
], ids=["initial_zero", "period_float", "multiplier_nan", "last_arg_bad",
        "fixed_bool"])
def test_rejected_arguments_leave_no_variable_in_tf1_graph(make, error):
    _assert_nothing_in_tf1_graph(make, error)


@pytest.mark.parametrize("kwargs", [
    dict(initial_loss_scale=1e-3),
    dict(initial_loss_scale=_FLOAT32_MAX),
    dict(initial_loss_scale=np.float32(4)),
    dict(increment_period=1),
    dict(increment_period=np.int32(7)),
    dict(increment_period=2**63 - 1),
    dict(multiplier=1.0001),
    dict(multiplier=np.float64(3)),
], ids=lambda kwargs: ",".join(f"{k}={v!r}" for k, v in kwargs.items()))
def test_dynamic_accepts_boundary_values_and_creates_its_two_variables(kwargs):
    with _counting_variable_creations() as created:
        loss_scale = tf_lossscale.DynamicLossScale(**kwargs)
    assert sorted(created) == ["current_loss_scale", "good_steps"]
    for name, value in kwargs.items():
        assert getattr(loss_scale, name) == value


# Values TensorFlow's reference takes without complaint.
_ACCEPTED_BY_TF_REFERENCE = [
    (lambda m: m.FixedLossScale(True), TypeError),
    (lambda m: m.FixedLossScale(_INF), ValueError),
    (lambda m: m.DynamicLossScale(initial_loss_scale=0), ValueError),
    (lambda m: m.DynamicLossScale(initial_loss_scale=_NAN), ValueError),
    (lambda m: m.DynamicLossScale(multiplier=1), ValueError),
    (lambda m: m.DynamicLossScale(increment_period=0), ValueError),
]


@pytest.mark.parametrize(
    "make, error", _ACCEPTED_BY_TF_REFERENCE,
    ids=["fixed_true", "fixed_inf", "dynamic_initial_zero",
         "dynamic_initial_nan", "dynamic_multiplier_one",
         "dynamic_period_zero"])
def test_rejects_values_tf_reference_silently_accepts(make, error):
    make(tf.compat.v1.mixed_precision)
    with pytest.raises(error):
        make(tf_lossscale)


_GET_ERRORS = ["unknown", "Dynamic", "fixed", "", True, False,
               np.bool_(False), [2], (2.0,), {2.0}, object,
               tf.constant(2.0), np.array([1.0, 2.0])]


@pytest.mark.parametrize("identifier", _GET_ERRORS, ids=repr)
def test_get_rejects_unknown_identifier_naming_it(identifier):
    with _counting_variable_creations() as created:
        with pytest.raises(ValueError) as raised:
            tf_lossscale.get(identifier)
    assert repr(identifier) in str(raised.value) or (
        str(identifier) in str(raised.value))
    assert not created


@pytest.mark.parametrize("identifier", [0.5, 0, -4, _NAN, _INF], ids=repr)
def test_get_rejects_out_of_range_number(identifier):
    with pytest.raises(ValueError, match="loss_scale_value"):
        tf_lossscale.get(identifier)

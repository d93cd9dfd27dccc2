"""Constructor arguments: what is accepted at the edges, what is refused in
combination, in TF1 graphs and by `get`.

Each argument alone at its type and range edges is refused (exception, name,
value, nothing created) in tests/step/test_hostile_inputs.py, with the
values of tests/helpers/hostile_values.py. TensorFlow's reference loss
scales accept several of those values and then misbehave (a scale of 0 or
NaN, a multiplier of 1 that never grows); this library refuses them.
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
# Not state: the record an XLA step leaves for the host, made with the state
# in TF2 programs and never saved (tests/xla/test_xla_record.py).
_XLA_RECORD = "xla_step_record"


@contextlib.contextmanager
def _counting_variable_creations():
    created = []

    def creator(next_creator, **kwargs):
        created.append(kwargs.get("name"))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield created


@pytest.mark.parametrize("value", [1, 1.0, np.float32(1.5), _FLOAT32_MAX],
                         ids=repr)
def test_fixed_accepts_boundary_values(value):
    loss_scale = tf_lossscale.FixedLossScale(value)
    assert loss_scale().numpy() == np.float32(value)


def _dynamic(**kwargs):
    return lambda: tf_lossscale.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("make, error", [
    (_dynamic(initial_loss_scale=0), ValueError),
    (_dynamic(increment_period=2.5), TypeError),
    (_dynamic(multiplier=_NAN), ValueError),
    # A valid argument before a bad one must not leave its variable behind.
    (_dynamic(initial_loss_scale=8, increment_period=1, multiplier=1),
     ValueError),
    (lambda: tf_lossscale.FixedLossScale(True), TypeError),
    (_dynamic(initial_loss_scale=8, hysteresis=1.5), TypeError),
    (_dynamic(initial_loss_scale=8, backoff_factor=1.0), ValueError),
    (_dynamic(hysteresis=3, on_min_loss_scale="stop"), ValueError),
    (_dynamic(hysteresis=3, max_consecutive_skips=0), ValueError),
    (_dynamic(initial_loss_scale=4, min_loss_scale=8), ValueError),
    (lambda: tf_lossscale.FixedLossScale(4, skip_non_finite=1), TypeError),
], ids=["initial_zero", "period_float", "multiplier_nan", "last_arg_bad",
        "fixed_bool", "hysteresis_fraction", "backoff_one",
        "policy_after_hysteresis", "skips_after_hysteresis",
        "floor_above_initial", "fixed_skip_int"])
def test_rejected_arguments_leave_no_variable_in_tf1_graph(make, error):
    with tf.Graph().as_default():
        with pytest.raises(error):
            make()
        assert not tf.compat.v1.global_variables()


@pytest.mark.parametrize("kwargs", [
    dict(initial_loss_scale=1e-3),
    dict(initial_loss_scale=_FLOAT32_MAX),
    dict(initial_loss_scale=np.float32(4)),
    dict(increment_period=1),
    dict(increment_period=np.int32(7)),
    dict(increment_period=2**63 - 1),
    dict(increment_period=2.0),
    dict(increment_period=np.float64(3.0)),
    dict(multiplier=1.0001),
    dict(multiplier=np.float64(3)),
], ids=lambda kwargs: ",".join(f"{k}={v!r}" for k, v in kwargs.items()))
def test_dynamic_accepts_boundary_values_and_creates_its_two_variables(kwargs):
    with _counting_variable_creations() as created:
        loss_scale = tf_lossscale.DynamicLossScale(**kwargs)
    assert sorted(created) == ["current_loss_scale", "good_steps",
                               _XLA_RECORD]
    for name, value in kwargs.items():
        assert getattr(loss_scale, name) == value


@pytest.mark.parametrize("value", [2.0, np.float64(7.0), np.float32(3.0)],
                         ids=repr)
def test_whole_float_count_becomes_an_int(value):
    loss_scale = tf_lossscale.DynamicLossScale(increment_period=value)
    assert loss_scale.increment_period == int(value)
    assert type(loss_scale.increment_period) is int  # pylint: disable=unidiomatic-typecheck
    assert type(loss_scale.get_config()["increment_period"]) is int  # pylint: disable=unidiomatic-typecheck


@pytest.mark.parametrize("kwargs, names", [
    (dict(initial_loss_scale=8, min_loss_scale=16),
     ("min_loss_scale", "initial_loss_scale")),
    # Compared as float32: 1 + 1e-7 is above 1 there too.
    (dict(initial_loss_scale=1, min_loss_scale=1 + 1e-7),
     ("min_loss_scale", "initial_loss_scale")),
    (dict(initial_loss_scale=0.5, min_loss_scale=1.0),
     ("min_loss_scale", "initial_loss_scale")),
    (dict(initial_loss_scale=8, max_loss_scale=4),
     ("max_loss_scale", "initial_loss_scale")),
    (dict(initial_loss_scale=0.5, min_loss_scale=0.25, max_loss_scale=0.125),
     ("max_loss_scale", "initial_loss_scale")),
    # The default floor counts too: growth could never reach it.
    (dict(initial_loss_scale=0.5, max_loss_scale=0.75),
     ("max_loss_scale", "min_loss_scale")),
], ids=["floor_above_initial", "floor_above_initial_in_float32",
        "explicit_default_floor_above_initial", "ceiling_below_initial",
        "ceiling_below_initial_and_floor", "ceiling_below_default_floor"])
def test_dynamic_rule_rejects_contradictory_bounds(kwargs, names):
    with _counting_variable_creations() as created:
        with pytest.raises(ValueError) as raised:
            tf_lossscale.DynamicLossScale(**kwargs)
    for name in names:
        assert re.search(rf"\b{name}\b", str(raised.value)), raised.value
    assert not created


@pytest.mark.parametrize("kwargs, extra_variables", [
    (dict(backoff_factor=0.5), []),
    (dict(backoff_factor=np.float32(0.25)), []),
    (dict(backoff_factor=1 - 1e-7), []),
    (dict(min_loss_scale=2**-24), []),
    (dict(initial_loss_scale=4, min_loss_scale=4), []),
    (dict(initial_loss_scale=0.5), []),
    (dict(max_loss_scale=2**15), []),
    (dict(max_loss_scale=_FLOAT32_MAX), []),
    (dict(hysteresis=1), []),
    (dict(hysteresis=2.0), ["hysteresis_remaining"]),
    (dict(hysteresis=np.int64(5), consecutive_hysteresis=True),
     ["hysteresis_remaining"]),
    (dict(consecutive_hysteresis=np.bool_(True)), []),
    (dict(on_min_loss_scale="continue"), []),
    (dict(on_min_loss_scale="warn"), ["consecutive_skips"]),
    (dict(on_min_loss_scale="raise"), ["consecutive_skips"]),
    (dict(max_consecutive_skips=1), ["consecutive_skips"]),
    (dict(max_consecutive_skips=3.0, hysteresis=2),
     ["consecutive_skips", "hysteresis_remaining"]),
], ids=lambda kwargs: ",".join(f"{k}={v!r}" for k, v in kwargs.items())
    if isinstance(kwargs, dict) else "")
def test_dynamic_rule_accepts_valid_values_creating_only_needed_state(
        kwargs, extra_variables):
    with _counting_variable_creations() as created:
        loss_scale = tf_lossscale.DynamicLossScale(**kwargs)
    assert sorted(created) == sorted(
        ["current_loss_scale", "good_steps", _XLA_RECORD] + extra_variables)
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
    (lambda m: m.DynamicLossScale(increment_period=2.5), TypeError),
]


@pytest.mark.parametrize(
    "make, error", _ACCEPTED_BY_TF_REFERENCE,
    ids=["fixed_true", "fixed_inf", "dynamic_initial_zero",
         "dynamic_initial_nan", "dynamic_multiplier_one",
         "dynamic_period_zero", "dynamic_period_fraction"])
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

"""Which gradients count as finite, and which are refused.

Each case is checked three ways: `gradient_checks.all_finite` eagerly and in
a `tf.function`, and through `DynamicLossScale.update`, whose verdict must
match TensorFlow's reference loss scale on the same gradients.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale.ops import finiteness as gradient_checks

_NAN = float("nan")
_INF = float("inf")
_FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
_BAD_VALUES = {"nan": _NAN, "pos_inf": _INF, "neg_inf": -_INF}


def _dense(values, dtype=tf.float32):
    return tf.constant(values, dtype=dtype)


def _slices(values, dtype=tf.float32):
    # Integer indices and dense_shape: only the values are gradients.
    return tf.IndexedSlices(
        _dense(values, dtype),
        tf.constant(list(range(len(values))), tf.int64),
        tf.constant([len(values) + 3], tf.int64))


def _long_with(position, value, length=1000):
    values = np.ones(length, np.float32)
    values[position] = value
    return tf.constant(values)


def _nested_with(value):
    return {
        "encoder": {
            "layers": [
                (_dense([[1.0, 2.0]]), None),
                {"kernel": _dense([3.0]), "bias": _dense([4.0, value])},
            ],
        },
        "head": [None, _slices([5.0])],
    }


def _float16_overflow():
    # A float16 product beyond 65504 is the overflow loss scaling guards
    # against in practice.
    return [tf.constant([300.0], tf.float16) * tf.constant(300.0, tf.float16)]


# name -> (factory of gradients, whether they are all finite)
_CASES = {
    "single_tensor": (lambda: _dense([1.0, -2.0]), True),
    "single_tensor_nan": (lambda: _dense([1.0, _NAN]), False),
    "scalar": (lambda: _dense(3.0), True),
    "zero_size_tensor": (lambda: tf.zeros([0, 4]), True),
    "extreme_finite_values": (
        lambda: _dense([np.finfo(np.float32).max, -np.finfo(np.float32).max,
                        np.finfo(np.float32).tiny * 1e-3, 0.0, -0.0]), True),
    "list": (lambda: [_dense([1.0]), _dense([2.0, 3.0])], True),
    "tuple": (lambda: (_dense([1.0]), _dense([2.0, 3.0])), True),
    "dict": (lambda: {"w": _dense([1.0]), "b": _dense([2.0])}, True),
    "nested": (lambda: _nested_with(6.0), True),
    "nested_nan_deep_in_dict": (lambda: _nested_with(_NAN), False),
    "nested_inf_deep_in_dict": (lambda: _nested_with(_INF), False),
    "with_nones": (lambda: [None, _dense([1.0]), None], True),
    "nan_among_nones": (lambda: [None, _dense([_NAN]), None], False),
    "indexed_slices": (lambda: _slices([1.0, 2.0]), True),
    "indexed_slices_nan_in_values": (
        lambda: [_dense([1.0]), _slices([1.0, _NAN])], False),
    "indexed_slices_neg_inf_in_values": (
        lambda: {"embedding": _slices([-_INF, 1.0])}, False),
    "nan_in_first_element": (lambda: [_long_with(0, _NAN)], False),
    "nan_in_last_element": (lambda: [_long_with(-1, _NAN)], False),
    "pos_inf_in_first_element": (lambda: [_long_with(0, _INF)], False),
    "neg_inf_in_last_element": (lambda: [_long_with(-1, -_INF)], False),
    "nan_in_last_gradient": (
        lambda: [_dense([1.0])] * 5 + [_dense([2.0, _NAN])], False),
    "mixed_dtypes": (
        lambda: [_dense([1.0], tf.float16), _dense([2.0], tf.bfloat16),
                 _dense([3.0], tf.float64)], True),
    "mixed_dtypes_inf_in_float64": (
        lambda: [_dense([1.0], tf.float16), _dense([_INF], tf.float64)],
        False),
    "float16_overflow": (_float16_overflow, False),
}
for _dtype in _FLOAT_DTYPES:
    _CASES[f"{_dtype.name}_finite"] = (
        lambda d=_dtype: [_dense([1.0, -2.5, 0.0], d)], True)
    _CASES[f"{_dtype.name}_indexed_slices_finite"] = (
        lambda d=_dtype: [_slices([1.0, 2.0], d)], True)
    for _bad_name, _bad in _BAD_VALUES.items():
        _CASES[f"{_dtype.name}_{_bad_name}"] = (
            lambda d=_dtype, v=_bad: [_dense([1.0, v, 0.5], d)], False)
        _CASES[f"{_dtype.name}_indexed_slices_{_bad_name}"] = (
            lambda d=_dtype, v=_bad: [_slices([v, 1.0], d)], False)

# Nothing to check means nothing is wrong.
_EMPTY = {
    "empty_list": lambda: [],
    "empty_tuple": lambda: (),
    "empty_dict": lambda: {},
    "none": lambda: None,
    "list_of_nones": lambda: [None, None],
    "nested_nones": lambda: {"a": None, "b": [None, (None,)]},
}


def _assert_scalar_bool(tensor):
    assert isinstance(tensor, tf.Tensor)
    assert tensor.dtype == tf.bool and tensor.shape == ()


@pytest.mark.parametrize("case", _CASES.keys())
def test_all_finite_eagerly(case):
    grads, finite = _CASES[case]
    result = gradient_checks.all_finite(grads())
    _assert_scalar_bool(result)
    assert bool(result) is finite


@pytest.mark.parametrize("case", _CASES.keys())
def test_all_finite_in_tf_function(case):
    grads, finite = _CASES[case]
    seen = []

    @tf.function
    def check():
        result = gradient_checks.all_finite(grads())
        seen.append(result)
        return result

    assert bool(check()) is finite
    _assert_scalar_bool(seen[0])


@pytest.mark.parametrize("case", _CASES.keys())
def test_dynamic_update_verdict_matches_tf_reference(case):
    grads, finite = _CASES[case]
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=8, increment_period=3)
    reference = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=8, increment_period=3)
    _, should_apply = loss_scale.update(grads())
    _, reference_should_apply = reference.update(grads())
    assert bool(should_apply) is finite
    assert bool(should_apply) == bool(reference_should_apply)
    assert float(loss_scale()) == float(reference())
    assert int(loss_scale.good_steps) == (1 if finite else 0)


@pytest.mark.parametrize("grads", _EMPTY.values(), ids=_EMPTY.keys())
def test_no_gradients_count_as_finite(grads):
    result = gradient_checks.all_finite(grads())
    _assert_scalar_bool(result)
    assert bool(result)
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=8, increment_period=1)
    _, should_apply = loss_scale.update(grads())
    assert bool(should_apply)
    assert float(loss_scale()) == 16.0


@pytest.mark.parametrize("grads", _EMPTY.values(), ids=_EMPTY.keys())
def test_no_gradients_count_as_finite_in_tf_function(grads):
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=8, increment_period=1)

    @tf.function
    def step():
        return loss_scale.update(grads())[1]

    assert bool(step())
    assert float(loss_scale()) == 16.0


def test_all_finite_compiles_with_xla():
    @tf.function(jit_compile=True)
    def check(values, dense):
        return gradient_checks.all_finite(
            {"slices": tf.IndexedSlices(values, tf.constant([0, 2])),
             "dense": [dense, None]})

    finite = tf.constant([1.0, 2.0], tf.float16)
    assert bool(check(finite, tf.constant([3.0])))
    assert not bool(check(finite, tf.constant([_NAN])))
    assert not bool(check(tf.constant([_INF, 1.0], tf.float16),
                          tf.constant([3.0])))


# name -> (factory of gradients, flat position of the offender, its dtype)
_NON_FLOATING = {
    "int32_after_float": (
        lambda: [_dense([1.0]), tf.constant([1], tf.int32)], 1, "int32"),
    "int64_after_none": (
        lambda: [None, _dense([1.0]), tf.constant([1], tf.int64)], 2, "int64"),
    "bool_alone": (lambda: tf.constant([True]), 0, "bool"),
    "int32_in_dict": (
        lambda: {"a": _dense([1.0]), "b": tf.constant([2], tf.int32)}, 1,
        "int32"),
    "int32_indexed_slices_values": (
        lambda: [tf.IndexedSlices(tf.constant([1], tf.int32),
                                  tf.constant([0]))], 0, "int32"),
    "complex64": (lambda: [tf.constant([1 + 2j], tf.complex64)], 0,
                  "complex64"),
    "string": (lambda: [_dense([1.0]), tf.constant(["a"])], 1, "string"),
}


@pytest.mark.parametrize("case", _NON_FLOATING.keys())
def test_non_floating_gradient_raises_type_error_naming_it(case):
    grads, position, dtype_name = _NON_FLOATING[case]
    with pytest.raises(TypeError) as raised:
        tf_lossscale.DynamicLossScale().update(grads())
    message = str(raised.value)
    assert dtype_name in message
    assert re.search(rf"\b{position}\b", message)


@pytest.mark.parametrize("case", _NON_FLOATING.keys())
def test_non_floating_gradient_leaves_loss_scale_untouched(case):
    grads = _NON_FLOATING[case][0]
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=8, increment_period=3)
    loss_scale.update([_dense([1.0])])
    with pytest.raises(TypeError):
        loss_scale.update(grads())
    assert float(loss_scale()) == 8.0
    assert int(loss_scale.good_steps) == 1


def test_non_floating_gradient_raises_when_tracing_and_changes_nothing():
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=8, increment_period=3)

    @tf.function
    def step(grad):
        return loss_scale.update([_dense([1.0]), grad])[1]

    with pytest.raises(TypeError, match="int32"):
        step(tf.constant([1], tf.int32))
    assert float(loss_scale()) == 8.0
    assert int(loss_scale.good_steps) == 0
    assert bool(step(_dense([2.0])))
    assert int(loss_scale.good_steps) == 1


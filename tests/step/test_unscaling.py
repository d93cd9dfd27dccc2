"""Unscaling is one correctly rounded division per value, however it is packed.

`tf_lossscale.ops.unscaling` packs tiny gradients into one tensor, divides once
and splits them back; in graphs, `gradient_checks.all_finite` then checks the
pack instead of the pieces. These tests pin that this changes nothing a user
can see: every value equals the per-gradient divide bit for bit (every float
dtype, scalars, odd shapes, scales that are not powers of two), structure,
`None`, `IndexedSlices` and kept gradients come back as they were, and a
finiteness verdict over packed gradients is exact, including when only some
of one pack's gradients are checked.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import reference_oracle as oracle
import tf_lossscale
from tf_lossscale.ops import finiteness as gradient_checks
from tf_lossscale.ops import unscaling

pytestmark = pytest.mark.usefixtures("keras_isolation")

_FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
# Tiny (packed), at the packing limit, and just above it (divided alone).
_SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (4096,), (64, 64), (4097,)]


def _random_grads(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.cast(tf.constant(rng.standard_normal(shape) * 3e3), dtype)
            for shape in _SHAPES]


def _as_float64(tensor):
    return tf.cast(tensor, tf.float64).numpy()


def _assert_bit_identical(actual, expected):
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(_as_float64(actual), _as_float64(expected))


# One trace per dtype, shared by the cases: the scale is an argument.
_traced_unscale = tf.function(unscaling.unscale)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("scale", [2.0 ** 15, 3.0, 1000.0, 0.75],
                         ids=["power_of_two", "three", "thousand", "below_one"])
@pytest.mark.parametrize("dtype", _FLOAT_DTYPES, ids=lambda d: d.name)
def test_packed_unscale_is_bit_identical_to_dividing_each_gradient(
        dtype, scale, traced):
    grads = _random_grads(dtype)
    fn = _traced_unscale if traced else unscaling.unscale
    unscaled = fn(grads, tf.constant(scale))
    for actual, grad in zip(unscaled, grads):
        _assert_bit_identical(actual, oracle.reference_unscale(grad, scale))


def test_mixed_dtypes_are_packed_apart_and_each_keeps_its_dtype():
    grads = [g for dtype in _FLOAT_DTYPES for g in _random_grads(dtype, 3)]
    unscaled = tf.function(unscaling.unscale)(grads, tf.constant(1000.0))
    for actual, grad in zip(unscaled, grads):
        _assert_bit_identical(actual, oracle.reference_unscale(grad, 1000.0))


def test_none_slices_and_kept_gradients_come_back_as_given():
    dense = tf.constant([2.0, 4.0])
    kept = tf.constant([8.0, 16.0])
    slices = tf.IndexedSlices(tf.constant([[6.0, 12.0]]), tf.constant([1]),
                              tf.constant([3, 2]))
    grads = [dense, None, kept, slices, tf.constant([10.0])]
    unscaled = unscaling.unscale(grads, tf.constant(2.0),
                                 keep=[False, False, True, False, False])
    np.testing.assert_array_equal(unscaled[0], [1.0, 2.0])
    assert unscaled[1] is None
    assert unscaled[2] is kept
    assert isinstance(unscaled[3], tf.IndexedSlices)
    np.testing.assert_array_equal(unscaled[3].values, [[3.0, 6.0]])
    np.testing.assert_array_equal(unscaled[3].indices, [1])
    np.testing.assert_array_equal(unscaled[4], [5.0])


def test_nested_structures_keep_their_shape():
    grads = {"b": [tf.constant(4.0), None], "a": (tf.constant([2.0, 6.0]),)}
    unscaled = unscaling.unscale_structure(grads, tf.constant(2.0))
    assert unscaled["b"][1] is None
    np.testing.assert_array_equal(unscaled["b"][0], 2.0)
    np.testing.assert_array_equal(unscaled["a"][0], [1.0, 3.0])


def test_a_thousand_tiny_gradients_take_a_handful_of_ops_in_graphs():
    grads = [tf.constant(np.ones(1000, np.float32)) for _ in range(1000)]
    graph = tf.function(
        lambda: gradient_checks.all_finite(
            unscaling.unscale(grads, tf.constant(4.0)))
    ).get_concrete_function().graph
    divides = [op for op in graph.get_operations() if op.type == "RealDiv"]
    finiteness = [op for op in graph.get_operations()
                  if op.type in ("IsFinite", "MatMul", "Sum")]
    assert len(divides) == 1
    assert len(finiteness) <= 3
    # The check reads the packed quotient, not its pieces stacked again.
    assert not [op for op in graph.get_operations() if op.type == "Pack"]


# ---------------------------------------------------------------------------
# Finiteness through the pack.


@tf.function
def _check_unscaled(grads, which):
    unscaled = unscaling.unscale(grads, tf.constant(8.0))
    return gradient_checks.all_finite([unscaled[i] for i in which])


def _packed_then_checked(grads, which):
    """all_finite over the unscaled gradients at positions `which`, traced
    (once per dtypes, shapes and `which`: the values are arguments)."""
    return bool(_check_unscaled(grads, tuple(which)))


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")],
                         ids=["nan", "inf", "-inf"])
def test_a_non_finite_value_in_any_packed_gradient_is_seen(dtype, bad):
    for position in range(len(_SHAPES)):
        grads = _random_grads(dtype, 5)
        values = _as_float64(grads[position]).reshape(-1)
        values[values.size // 2] = bad
        grads[position] = tf.cast(
            tf.constant(values.reshape(grads[position].shape)), dtype)
        assert not _packed_then_checked(grads, range(len(grads))), position


def test_only_the_packed_gradients_checked_decide_the_verdict():
    grads = [tf.constant([1.0, 2.0]), tf.constant([float("nan"), 1.0]),
             tf.constant([[3.0]])]
    assert _packed_then_checked(grads, [0, 2])
    assert _packed_then_checked(grads, [0])
    assert not _packed_then_checked(grads, [1])
    assert not _packed_then_checked(grads, [2, 1, 0])


def test_a_packed_gradient_checked_twice_is_still_exact():
    grads = [tf.constant([1.0]), tf.constant([float("inf")])]
    assert _packed_then_checked(grads, [0, 0])
    assert not _packed_then_checked(grads, [0, 1, 1, 0])


def test_tf2_protocol_skips_a_nan_hidden_among_a_thousand_tiny_gradients():
    grads = [tf.constant(np.full(100, 1e3, np.float32)) for _ in range(1000)]
    grads[617] = tf.tensor_scatter_nd_update(grads[617], [[42]],
                                             [float("nan")])
    loss_scale = tf_lossscale.DynamicLossScale(1024.0, increment_period=10)
    optimizer = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(),
                                                loss_scale=loss_scale)

    @tf.function
    def step(grads):
        return loss_scale.update(optimizer.get_unscaled_gradients(grads))[1]

    assert not bool(step(grads))
    assert float(loss_scale()) == 512.0
    # The same gradients made finite: no second trace of a thousand.
    grads[617] = tf.ones_like(grads[617])
    assert bool(step(grads))
    assert int(loss_scale.good_steps) == 1


@pytest.mark.parametrize("scale", [1000.0, 2.0 ** 12], ids=["thousand",
                                                             "power_of_two"])
def test_applied_steps_with_many_tiny_gradients_match_sgd_on_divided_ones(
        scale):
    rng = np.random.default_rng(4)
    shapes = [(3, 5), (64,), (64,), (1,), (), (4096,), (5000,)]
    initial = [rng.standard_normal(shape).astype(np.float32)
               for shape in shapes]
    ours_vars = [tf.Variable(value) for value in initial]
    reference_vars = [tf.Variable(value) for value in initial]
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.5, momentum=0.9),
        loss_scale=tf_lossscale.FixedLossScale(scale))
    reference = keras.optimizers.SGD(0.5, momentum=0.9)

    @tf.function
    def step(scaled):
        optimizer.scale_loss(tf.constant(1.0))  # The Keras protocol.
        optimizer.apply(scaled, ours_vars)
        reference.apply([oracle.reference_unscale(g, scale) for g in scaled],
                        reference_vars)

    for _ in range(3):
        step([tf.constant(rng.standard_normal(shape) * 3e3, tf.float32)
              for shape in shapes])
    for ours, theirs in zip(ours_vars, reference_vars):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_keep_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="keep must have one entry per "
                                         "gradient: got 1 for 2"):
        unscaling.unscale([tf.constant(1.0), tf.constant(2.0)],
                          tf.constant(2.0), keep=[True])

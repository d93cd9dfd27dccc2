"""The fast finiteness check is exact: it never trades a verdict for speed.

`gradient_checks.all_finite` takes shortcuts (stacked small gradients, one
sum per large gradient, an exact re-check only when that sum is not
finite). Each test compares it with the plain definition,
`all(is_finite(g))` over every gradient, on gradients built to hit every
shortcut: large and small, awkward sizes, unknown shapes, every float dtype,
`IndexedSlices`, and finite values so large that any sum of them overflows.

The optimizer's unscaling against TensorFlow's formula:
tests/keras/test_optimizer_protocol.py (`get_unscaled_gradients`) and
tests/step/test_loss_scaled_step.py (applied steps).
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_lossscale.ops import finiteness as gradient_checks

pytestmark = pytest.mark.usefixtures("keras_isolation")

_NAN = float("nan")
_INF = float("inf")
_FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
# Element counts that take each path: small (stacked), and large (summed;
# one of them a prime, as the check once treated those apart).
_SIZES = {"small": 1000, "large": 70000, "large_prime": 65537}


def _definition(grads):
    """The verdict by definition, computed in numpy."""
    for grad in tf.nest.flatten(grads):
        if grad is None:
            continue
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        if not np.isfinite(tf.cast(values, tf.float64).numpy()).all():
            return False
    return True


# One tf.function for every test: a trace per kind of input (dtypes and
# shapes), reused for other values, as a training step's graph is.
_traced_all_finite = tf.function(gradient_checks.all_finite)


def _both_ways(grads):
    """The fast verdict eagerly and inside a tf.function."""
    eager = bool(gradient_checks.all_finite(grads))
    traced = bool(_traced_all_finite(grads))
    return eager, traced


def _filled(count, value, dtype, position=None, bad=None):
    values = np.full(count, value, np.float64)
    if position is not None:
        values[position] = bad
    return tf.cast(tf.constant(values), dtype)


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("size", _SIZES.keys())
@pytest.mark.parametrize("bad", [_NAN, _INF, -_INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_any_non_finite_element_is_found_on_every_path(dtype, size, bad, where):
    count = _SIZES[size]
    position = {"first": 0, "middle": count // 2, "last": count - 1}[where]
    grads = [_filled(count, 0.5, dtype), _filled(count, -1.0, dtype),
             _filled(count, 0.25, dtype, position, bad)]
    assert _both_ways(grads) == (False, False)
    assert not _definition(grads)


def _largest(dtype):
    return float(dtype.max)


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("size", _SIZES.keys())
def test_largest_finite_values_whose_sums_overflow_are_finite(dtype, size):
    count = _SIZES[size]
    largest = _largest(dtype)
    grads = [_filled(count, largest, dtype), _filled(count, -largest, dtype),
             # Alternating signs: partial sums swing without cancelling.
             tf.cast(tf.constant(np.resize([largest, largest, -largest],
                                           count)), dtype)]
    # A plain sum in their dtype overflows: a shortcut trusting it would skip.
    assert not np.isfinite(
        tf.cast(tf.reduce_sum(grads[0]), tf.float64).numpy())
    assert _both_ways(grads) == (True, True)


def test_float16_gradients_at_their_maximum_are_finite():
    count = _SIZES["large"]
    grads = [tf.fill([count], tf.constant(65504.0, tf.float16)),
             tf.fill([7, 3], tf.constant(-65504.0, tf.float16))]
    assert _both_ways(grads) == (True, True)


def test_float64_values_beyond_float32_range_are_finite_and_inf_is_not():
    count = _SIZES["large"]
    huge = _filled(count, 1e300, tf.float64)
    assert _both_ways([huge]) == (True, True)
    assert _both_ways([huge, _filled(count, 1.0, tf.float64, 5, _INF)]) == (
        False, False)


_WIDTH = 64


@tf.function(input_signature=[tf.TensorSpec([None, _WIDTH], tf.float32)])
def _check_slices_of_unknown_row_count(values):
    rows = tf.shape(values)[0]
    return gradient_checks.all_finite([tf.IndexedSlices(
        values, tf.range(rows), tf.stack([rows, _WIDTH]))])


@pytest.mark.parametrize("bad", [None, _NAN, _INF], ids=["finite", "nan", "inf"])
@pytest.mark.parametrize("rows", [3, 2000], ids=["few_rows", "many_rows"])
def test_indexed_slices_of_unknown_row_count_are_checked_exactly(bad, rows):
    values = np.full((rows, _WIDTH), np.finfo(np.float32).max, np.float32)
    if bad is not None:
        values[rows - 1, _WIDTH - 1] = bad

    assert bool(_check_slices_of_unknown_row_count(tf.constant(values))) is (
        bad is None)


def test_random_gradient_sets_agree_with_the_definition():
    rng = np.random.default_rng(7)
    shapes = [(3,), (3,), (64, 64), (64, 64), (300, 301), (70001,), (5, 7, 9),
              (2, 40000)]
    checked = 0
    for trial in range(60):
        grads = []
        for shape in shapes:
            dtype = _FLOAT_DTYPES[rng.integers(len(_FLOAT_DTYPES))]
            values = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)
            if rng.random() < 0.1:
                values.flat[rng.integers(values.size)] = rng.choice(
                    [_NAN, _INF, -_INF])
            if rng.random() < 0.05:
                values[...] = _largest(dtype) * np.sign(values + 0.5)
            grads.append(tf.cast(tf.constant(values), dtype))
        expected = _definition(grads)
        assert _both_ways(grads) == (expected, expected), trial
        checked += not expected
    assert 0 < checked < 60  # Both verdicts were exercised.

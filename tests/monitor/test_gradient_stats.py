"""`tf_lossscale.ops.float16`: statistics against float16's range.

Each figure is compared with numpy's count on the same values cast to
float16, in eager mode, in a `tf.function` and under XLA (where a maximum
skips NaN, so a NaN must still read as an overflow).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

from tf_lossscale.ops import float16 as gradient_stats

_MODES = {
    "eager": lambda fn: fn,
    "graph": tf.function,
    # The caller says it traces for XLA (the step core asks xla_record).
    "xla": lambda fn: tf.function(functools.partial(fn, xla=True),
                                  jit_compile=True),
}
# The functions under test in each mode, made once: the values and scales
# are arguments, so cases of one mode share a trace (an XLA compile each).
_SCALED_GRADIENT_STATS = {
    mode: wrap(gradient_stats.scaled_gradient_stats)
    for mode, wrap in _MODES.items()}
_LARGEST_MAGNITUDE = {mode: wrap(gradient_stats.largest_magnitude)
                      for mode, wrap in _MODES.items()}


def _float16_values(seed=0, size=4000):
    """float16 values spread from below 2**-24 to above 2**10, with zeros,
    as float32 (a float32 variable's gradient under mixed_float16)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(size) * 2.0 ** rng.uniform(-30, 10, size)
    values[::50] = 0.0
    return values.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("scale", [1.0, 2.0**10, 2.0**-3])
def test_scaled_stats_count_values_below_float16_normals(mode, scale):
    grads = [_float16_values(0).reshape(40, 100), _float16_values(1)[:7],
             None]
    unscaled = [None if g is None else tf.constant(g / scale) for g in grads]

    tiny, count, largest = _SCALED_GRADIENT_STATS[mode](
        unscaled, tf.constant(scale))

    values = np.concatenate([np.ravel(g) for g in grads if g is not None])
    assert count == values.size
    assert tiny == np.sum(np.abs(values) < 2.0**-14)
    assert 0 < tiny < values.size
    assert largest == np.abs(values).max()


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_makes_the_largest_infinite(mode, bad):
    values = _float16_values()
    values[123] = bad

    _, _, largest = _SCALED_GRADIENT_STATS[mode](
        [tf.constant(values)], tf.constant(8.0))

    assert largest == np.inf


def test_indexed_slices_count_their_rows():
    values = _float16_values()[:30].reshape(10, 3)
    grad = tf.IndexedSlices(tf.constant(values), tf.range(10),
                            tf.constant([100, 3]))

    tiny, count, largest = gradient_stats.scaled_gradient_stats([grad], 1.0)

    assert count == 30
    assert tiny == np.sum(np.abs(values) < 2.0**-14)
    assert largest == np.abs(values).max()


def test_no_gradients_give_zeros():
    np.testing.assert_array_equal(
        gradient_stats.scaled_gradient_stats([None], 4.0), [0.0, 0.0, 0.0])


def _by_variable(float16, float32, scale=1.0):
    """The per-variable figures of two "variables", `float32[:3]` and
    `float32[3:]` (and the same split of `float16`), flattened as the
    diagnosis flattens them."""
    variables = [tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([2, 2]))]
    parts = [float32[:3], float32[3:].reshape(2, 2)]
    flat32 = gradient_stats.flatten(parts, variables)
    flat16 = gradient_stats.flatten(
        [float16[:3], float16[3:].reshape(2, 2)], variables)
    ids = gradient_stats.variable_ids(variables)
    underflow, squares = gradient_stats.underflow_by_variable(
        flat16, flat32, tf.constant(scale), ids, 2)
    return {
        "underflow": underflow.numpy().tolist(),
        "squares": squares.numpy().tolist(),
        "nonzero": gradient_stats.nonzero_by_variable(
            flat32, ids, 2).numpy().tolist(),
        "all_squares": gradient_stats.squares_by_variable(
            flat32, ids, 2).numpy().tolist(),
        "largest": gradient_stats.largest_by_variable(
            flat16, ids, 2).numpy().tolist(),
        "nonfinite": gradient_stats.nonfinite_by_variable(
            flat16, ids, 2).numpy().tolist(),
    }


def test_underflow_by_variable_compares_with_the_float32_gradient():
    float32 = np.array([0.0, 1e-9, 1e-6, 1e-3, -1e-7, 0.0, 3.0], np.float32)
    # As a float16 backward pass at scale 1 gives them: 1e-9 flushes to 0,
    # 1e-6 and -1e-7 become subnormal; the two true zeros stay zeros.
    float16 = float32.astype(np.float16).astype(np.float32)
    wide = float32.astype(np.float64)
    lost = wide - float16.astype(np.float64)

    figures = _by_variable(float16, float32)

    # Variable 0: [0, 1e-9, 1e-6]; variable 1: [1e-3, -1e-7, 0, 3].
    assert figures["underflow"] == [2.0, 1.0]
    assert figures["nonzero"] == [2.0, 3.0]
    # All of 1e-9 is lost, and the bits of 1e-6 and -1e-7 float16 drops.
    np.testing.assert_allclose(figures["squares"], [
        lost[1]**2 + lost[2]**2, lost[4]**2], rtol=1e-12)
    np.testing.assert_allclose(figures["all_squares"], [
        np.sum(wide[:3]**2), np.sum(wide[3:]**2)], rtol=1e-12)
    assert figures["largest"] == [float(np.float32(float16[2])), 3.0]
    assert figures["nonfinite"] == [0.0, 0.0]
    # At scale 2**20 (3.0 left out: it would overflow), 1e-9 becomes ~1e-3
    # and nothing but the true zeros is below 2**-14.
    scaled = (float32 * 2.0**20).astype(np.float16).astype(np.float32)
    scaled[-1] = 0.0
    assert _by_variable(scaled, float32, 2.0**20)["underflow"][0] == 0.0


def test_flattened_figures_see_non_finite_values_and_squares_of_tiny_ones():
    float32 = np.array([1e-30, 0.0, 0.0, np.inf, 1.0, np.nan, 2.0],
                       np.float32)

    figures = _by_variable(float32, float32)

    assert figures["nonfinite"] == [0.0, 1.0]
    assert figures["largest"][1] == np.inf
    # 1e-30 squared is below float32's range, not float64's.
    assert figures["all_squares"][0] == pytest.approx(1e-60, rel=1e-6)


@pytest.mark.parametrize("mode", _MODES)
def test_largest_magnitude_of_tensors(mode):
    values = _float16_values()
    assert _LARGEST_MAGNITUDE[mode](
        [tf.constant(values), tf.constant(values[:3])]) == (
            np.abs(values).max())
    values[7] = np.nan
    assert _LARGEST_MAGNITUDE[mode](tf.constant(values)) == np.inf


def _numpy_stats(arrays, scale):
    """`[tiny, count, largest]` by numpy, as the docstring defines them."""
    values = np.concatenate([np.ravel(a).astype(np.float32) for a in arrays])
    magnitudes = np.abs(values)
    threshold = np.float32(2.0**-14) / np.float32(scale)
    largest = (np.float32(magnitudes.max()) * np.float32(scale)
               if np.isfinite(values).all() else np.inf)
    return [float(np.sum(magnitudes < threshold)), float(values.size),
            float(largest)]


def _gradient_mix(seed=0):
    """Many small gradients of several shapes and dtypes (measured
    concatenated), and larger ones (measured alone)."""
    values = _float16_values(seed, size=300_000)
    arrays = [values[i * 12:(i + 1) * 12].reshape(3, 4) for i in range(20)]
    arrays += [values[300:305], values[400:400], values[500:500 + 70_000],
               values[100_000:300_000].reshape(400, 500)]
    dtypes = [np.float16, np.float32, np.float64]
    return [a.astype(dtypes[i % 3]) if a.size < 100 else a
            for i, a in enumerate(arrays)]


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("scale", [2.0**-3, 3.0, 2.0**15])
def test_many_small_and_some_large_gradients_of_several_dtypes(mode, scale):
    arrays = _gradient_mix()

    figures = _SCALED_GRADIENT_STATS[mode](
        [tf.constant(a / np.array(scale, a.dtype)) for a in arrays],
        tf.constant(scale))

    expected = _numpy_stats(
        [(a / np.array(scale, a.dtype)).astype(np.float32) for a in arrays],
        scale)
    assert figures.numpy().tolist() == expected
    assert 0 < expected[0] < expected[1]


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("where", ["small", "large"])
@pytest.mark.parametrize("bad", [np.nan, -np.nan, np.inf, -np.inf])
def test_a_non_finite_value_anywhere_makes_the_largest_infinite(
        mode, where, bad):
    arrays = [a.astype(np.float32) for a in _gradient_mix()]
    # -np.nan keeps its sign bit: the largest of the magnitudes' bits.
    arrays[3 if where == "small" else -1].flat[5] = bad

    tiny, count, largest = _SCALED_GRADIENT_STATS[mode](
        [tf.constant(a) for a in arrays], tf.constant(1.0))

    assert largest == np.inf
    # NaN and Inf are not tiny: the count is of the finite values.
    finite = _numpy_stats([np.nan_to_num(a, nan=1.0, posinf=1.0,
                                         neginf=1.0) for a in arrays], 1.0)
    assert [tiny, count] == finite[:2]


@pytest.mark.parametrize("scale", [3.0, 2.0**15, 2.0**-20])
def test_values_at_the_threshold_are_not_tiny_and_just_below_are(scale):
    threshold = np.float32(2.0**-14) / np.float32(scale)
    below = np.nextafter(threshold, np.float32(0.0))
    values = np.array([threshold, -threshold, below, -below, 0.0, -0.0],
                      np.float32)

    tiny, count, _ = gradient_stats.scaled_gradient_stats(
        [tf.constant(values)], tf.constant(scale))

    assert (tiny, count) == (4.0, 6.0)


def test_gradients_of_unknown_size_are_counted():
    values = _float16_values()[:300].reshape(100, 3)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def stats(rows, indices):
        grads = [tf.IndexedSlices(rows, indices, tf.constant([1000, 3],
                                                             tf.int64)),
                 tf.constant(values[:2] / 4.0)]
        return gradient_stats.scaled_gradient_stats(grads, tf.constant(4.0))

    figures = stats(tf.constant(values / 4.0), tf.range(100, dtype=tf.int64))

    assert figures.numpy().tolist() == _numpy_stats(
        [values / 4.0, values[:2] / 4.0], 4.0)


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_counts_beyond_a_narrow_sums_exact_range_are_exact(mode,
                                                             monkeypatch):
    # Past the limit each part counts in int64; with the limits lowered, a
    # small case takes the paths of a gradient of 2**24 (2**31) values.
    monkeypatch.setattr(gradient_stats, "_EXACT_COUNTS",
                        {"int32": 8, "float32": 8})
    monkeypatch.setattr(gradient_stats, "_CONCATENATED_ELEMENTS", 4)
    arrays = [a.astype(np.float32) for a in _gradient_mix(1)]

    figures = _MODES[mode](gradient_stats.scaled_gradient_stats)(
        [tf.constant(a) for a in arrays], tf.constant(2.0))

    assert figures.numpy().tolist() == _numpy_stats(arrays, 2.0)


@pytest.mark.parametrize("mode", ["graph", "xla"])
@pytest.mark.parametrize("where", [0, 1_500_000, 2_999_999])
def test_a_nan_anywhere_in_a_large_gradient_makes_the_largest_infinite(
        mode, where):
    # Without XLA the maximum's NaN is the only finiteness test: every
    # thread's share of a reduction this large must carry it.
    values = np.ones(3_000_000, np.float32)
    values[where] = np.nan

    _, _, largest = _SCALED_GRADIENT_STATS[mode](
        [tf.constant(values)], tf.constant(1.0))

    assert largest == np.inf

"""`finiteness.largest_magnitudes`: each gradient's largest |value|, +inf
exactly where the gradient is not finite (per-layer scaling's check reads
both from it; XLA's maximum may drop NaN). Compared with the definition,
computed in numpy, eagerly, traced and under XLA, for NaN and Inf at every
position of stacked, single and empty gradients."""

import numpy as np
import pytest
import tensorflow as tf

from tf_lossscale.ops import finiteness

_SHAPES = [(3, 4), (3, 4), (5,), (5,), (300, 300), (0, 2), ()]


def _gradients(dtype, bad, at):
    rng = np.random.default_rng(0)
    grads = []
    for index, shape in enumerate(_SHAPES):
        values = rng.standard_normal(shape) * 2.0 ** index
        if index == at and values.size:
            values.flat[values.size // 2] = bad
        grads.append(tf.cast(tf.constant(values), dtype))
    return grads


def _definition(grads):
    largest = []
    for grad in grads:
        values = np.abs(tf.cast(grad, tf.float64).numpy())
        largest.append(np.inf if np.isnan(values).any()
                       else float(values.max()) if values.size else 0.0)
    return np.array(largest, np.float32)


def _in_order(grads, run):
    largest, order = run(grads)
    result = np.empty(len(grads), np.float32)
    result[np.array(order, int)] = np.asarray(largest)
    return result


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32,
                                   tf.float64], ids=lambda d: d.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, None])
def test_largest_magnitudes_are_not_finite_exactly_where_the_gradients_are_not(
        dtype, bad):
    runs = {
        "eager": finiteness.largest_magnitudes,
        "traced": tf.function(finiteness.largest_magnitudes),
        "xla": tf.function(lambda g: finiteness.largest_magnitudes(
            g, xla=True), jit_compile=True),
    }
    for at in range(len(_SHAPES)) if bad is not None else [None]:
        grads = _gradients(dtype, 0.0 if bad is None else bad, at)
        expected = _definition(grads)
        for name, run in runs.items():
            got = _in_order(grads, lambda g: (lambda r: (r[0].numpy(), r[1]))(
                run(g)))
            np.testing.assert_array_equal(got, expected, err_msg=name)

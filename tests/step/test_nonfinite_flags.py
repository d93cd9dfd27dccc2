"""`gradient_checks.nonfinite_flags`: which gradients overflowed, exactly.

The overflow record of a skipped step (`last_nonfinite_variables()`) is built
from these flags. Small gradients of one shape are checked stacked, so a step
holds a handful of ops for a thousand tiny gradients of one shape: even a
branch that does not run costs the graph executor a little for each op it
holds. Every case is compared with the definition, computed in numpy,
eagerly and traced, on gradients as `unscaling.unscale` leaves them (packed,
then split back).
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_lossscale.ops import finiteness as gradient_checks
from tf_lossscale.ops import unscaling

_NAN = float("nan")
_INF = float("inf")
_FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]


def _definition(grads):
    flags = []
    for grad in grads:
        if grad is None:
            flags.append(False)
            continue
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        flags.append(not np.isfinite(
            tf.cast(values, tf.float64).numpy()).all())
    return flags


@tf.function
def _traced_flags(grads, which):
    unscaled = unscaling.unscale(grads, tf.constant(4.0))
    picked = unscaled if which is None else [unscaled[i] for i in which]
    return gradient_checks.nonfinite_flags(picked)


def _flags_of_unscaled(grads, which=None):
    """Traced: flags of the unscaled (packed) gradients at `which`. One
    trace per dtypes, shapes and `which`: the values are arguments."""
    return _traced_flags(grads, None if which is None else tuple(which)
                         ).numpy().tolist()


def _with_bad(shape, dtype, bad, rng):
    values = rng.standard_normal(shape)
    if bad is not None:
        values.flat[rng.integers(values.size)] = bad
    return tf.cast(tf.constant(values), dtype)


@pytest.mark.parametrize("dtype", _FLOAT_DTYPES, ids=lambda d: d.name)
def test_flags_of_packed_gradients_match_the_definition(dtype):
    rng = np.random.default_rng(3)
    # Same shapes (stacked), mixed shapes, and large ones (alone).
    shapes = [(7,), (7,), (7,), (3, 5), (1,), (64, 70), (2, 2, 2), (5000,)]
    for trial in range(12):
        bad_at = set(rng.choice(len(shapes), rng.integers(0, 3),
                                replace=False).tolist())
        grads = [_with_bad(shape, dtype, rng.choice([_NAN, _INF, -_INF])
                           if i in bad_at else None, rng)
                 for i, shape in enumerate(shapes)]
        expected = _definition(grads)
        assert _flags_of_unscaled(grads) == expected, trial
        eager = gradient_checks.nonfinite_flags(
            unscaling.unscale(grads, tf.constant(4.0)))
        assert eager.numpy().tolist() == expected, trial


def test_part_of_a_pack_repeated_and_reordered_is_flagged_by_position():
    grads = [tf.constant([1.0, 2.0]), tf.constant([_NAN, 1.0]),
             tf.constant([[3.0]]), tf.constant([4.0, -_INF, 0.0])]
    assert _flags_of_unscaled(grads, [0, 2]) == [False, False]
    assert _flags_of_unscaled(grads, [1]) == [True]
    assert _flags_of_unscaled(grads, [3, 1, 1, 0, 2]) == [
        True, True, True, False, False]


def test_none_and_indexed_slices_entries():
    slices = tf.IndexedSlices(tf.constant([[1.0, _INF]]), tf.constant([0]),
                              tf.constant([4, 2]))
    grads = [None, slices, tf.constant([2.0]), None,
             tf.IndexedSlices(tf.constant([[1.0, 1.0]]), tf.constant([1]),
                              tf.constant([4, 2]))]
    expected = [False, True, False, False, False]
    assert gradient_checks.nonfinite_flags(grads).numpy().tolist() == expected
    traced = tf.function(lambda: gradient_checks.nonfinite_flags(grads))()
    assert traced.numpy().tolist() == expected
    assert gradient_checks.nonfinite_flags([]).numpy().tolist() == []
    assert gradient_checks.nonfinite_flags([None]).numpy().tolist() == [False]


def test_splits_made_elsewhere_are_flagged_by_their_outputs():
    # A model's own unstack along another axis and a split of a matrix: not
    # packs of `unscaling`, still every one of their outputs.
    matrix = np.arange(12, dtype=np.float32).reshape(3, 4)
    matrix[2, 1] = _NAN

    @tf.function
    def flags():
        columns = tf.unstack(tf.constant(matrix), axis=1)
        halves = tf.split(tf.constant(matrix), [1, 3], axis=1)
        parts = tf.split(tf.reshape(tf.constant(matrix), [-1]), [9, 0, 3])
        return gradient_checks.nonfinite_flags(columns + halves + parts)

    assert flags().numpy().tolist() == [
        False, True, False, False, False, True, False, False, True]


def test_a_thousand_tiny_gradients_take_a_handful_of_ops_in_graphs():
    grads = [tf.constant(np.ones(1000, np.float32)) for _ in range(1000)]
    mixed = [tf.constant(np.ones(n, np.float32)) for n in range(1, 1001)]

    def ops_for(grads):
        """The computing ops `nonfinite_flags` adds to a graph that holds
        `unscale`'s: counted within one trace, which costs seconds."""
        added = []

        @tf.function
        def trace():
            unscaled = unscaling.unscale(grads, tf.constant(4.0))
            graph = tf.compat.v1.get_default_graph()
            before = len(graph.get_operations())
            flags = gradient_checks.nonfinite_flags(unscaled)
            added.extend(graph.get_operations()[before:])
            return flags

        trace.get_concrete_function()
        return len([op for op in added if op.type not in
                    ("Identity", "Const", "Placeholder", "NoOp")])

    # One shape: stacked. Each shape its own: no more than the plain form's
    # two ops per gradient.
    assert ops_for(grads) <= 10
    assert ops_for(mixed) <= 2 * len(mixed) + 10

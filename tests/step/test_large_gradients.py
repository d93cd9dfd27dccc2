"""Large gradients through the whole step: a finite step applies what
dividing first applies, bit for bit, and a step whose quotients are not all
finite is skipped, weights untouched.

Gradients of more than 65,536 values take the check's sum sentinel
(`finiteness.all_finite`) and are divided alone; the tiny ones are packed.
The cases: a scale that is a power of two, one that is not, a
dynamic scale below 1 (allowed by `min_loss_scale`) whose quotient overflows
where the scaled value did not, NaN and -Inf. Eagerly, in a `tf.function`,
under XLA and under a MirroredStrategy of two replicas; the Keras 3 and
tf-keras wrappers.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.helpers import reference_oracle as oracle
from tests.helpers import training
import tf_lossscale

pytestmark = pytest.mark.usefixtures("keras_isolation")

# Summed by the check's sentinel, checked stacked, packed for the divide.
_SHAPES = [(300, 300), (5000,), (7,)]
_LEARNING_RATE = 0.3
_MODES = ["eager", "tf_function", "xla"]


def _scaled_gradients(scale, seed=0, planted=None):
    """Gradients times `scale` (float32), with `planted` (a float) written
    into the large one's element 1234 when given."""
    rng = np.random.default_rng(seed)
    grads = [(rng.standard_normal(shape) * 50 * scale).astype(np.float32)
             for shape in _SHAPES]
    if planted is not None:
        grads[0].reshape(-1)[1234] = planted
    return [tf.constant(g) for g in grads]


_NAMES = ["large", "middle", "small"]


def _variables():
    rng = np.random.default_rng(1)
    return [tf.Variable(rng.standard_normal(shape).astype(np.float32),
                        name=name) for shape, name in zip(_SHAPES, _NAMES)]


def _run(fn, mode):
    if mode == "eager":
        return fn()
    return tf.function(fn, jit_compile=mode == "xla")()


def _wrapper_step(loss_scale, scaled, mode):
    """The variables after one `apply` of the Keras 3 wrapper, and it."""
    variables = _variables()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(_LEARNING_RATE), loss_scale=loss_scale)
    optimizer.build(variables)
    _run(lambda: optimizer.apply(scaled, variables), mode)
    return training.values_of(variables), optimizer


def _divided_first(loss_scale, scaled, mode, optimizers=keras.optimizers):
    """The variables after plain SGD (`optimizers.SGD`: Keras 3's or
    tf-keras') on the reference quotients, divided by the scale as
    `loss_scale()` gives it in the same function (a constant divisor is
    rewritten by TensorFlow's graph optimizer, a variable's not)."""
    variables = _variables()
    sgd = optimizers.SGD(_LEARNING_RATE)
    sgd.build(variables)
    _run(lambda: sgd.apply_gradients(zip(
        [oracle.reference_unscale(g, loss_scale()) for g in scaled],
        variables)), mode)
    return training.values_of(variables)


def _assert_same_values(actual, expected):
    for got, want in zip(actual, expected):
        np.testing.assert_array_equal(oracle.float32_bits(got),
                                      oracle.float32_bits(want))


_APPLIED = {
    "dynamic_power_of_two": (tf_lossscale.DynamicLossScale, 2.0 ** 15),
    # A scale held in a variable: TensorFlow's graph optimizer rewrites a
    # division by a constant (a FixedLossScale's) as it sees fit, in the
    # wrapper's graph and the reference's alike but not always the same way.
    "dynamic_three": (lambda: tf_lossscale.DynamicLossScale(3.0), 3.0),
    "dynamic_below_one": (lambda: tf_lossscale.DynamicLossScale(
        0.75, min_loss_scale=0.5), 0.75),
}


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("case", _APPLIED)
def test_a_finite_step_applies_the_quotients_bit_for_bit(case, mode):
    make_loss_scale, scale = _APPLIED[case]
    scaled = _scaled_gradients(scale)
    applied, optimizer = _wrapper_step(make_loss_scale(), scaled, mode)
    assert int(optimizer.skipped_steps) == 0
    _assert_same_values(applied,
                        _divided_first(make_loss_scale(), scaled, mode))


_SKIPPED = {
    # Finite as scaled, +inf once divided by 0.5: the reference skips it.
    "quotient_overflows_below_one": (0.5, 3e38),
    "nan": (2.0 ** 15, np.nan),
    "inf": (2.0 ** 15, -np.inf),
}


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("case", _SKIPPED)
def test_a_step_whose_quotients_are_not_finite_is_skipped(case, mode):
    scale, planted = _SKIPPED[case]
    scaled = _scaled_gradients(scale, planted=planted)
    assert not oracle.numpy_all_finite(
        [oracle.reference_unscale(g, scale).numpy() for g in scaled])
    loss_scale = tf_lossscale.DynamicLossScale(scale, min_loss_scale=0.25)
    before = training.values_of(_variables())
    after, optimizer = _wrapper_step(loss_scale, scaled, mode)
    _assert_same_values(after, before)
    assert int(optimizer.skipped_steps) == 1
    assert float(loss_scale()) == scale / 2
    assert optimizer.last_nonfinite_variables() == ["large"]


def _mirrored_step(make_optimizer, per_replica_scaled, unscale_first, scale):
    strategy = training.mirrored(2)
    with strategy.scope():
        variables = _variables()
        optimizer = make_optimizer()
        optimizer.build(variables)
    values = strategy.experimental_distribute_values_from_function(
        lambda context: per_replica_scaled[context.replica_id_in_sync_group])

    @tf.function
    def step(grads):
        if unscale_first:
            grads = [oracle.reference_unscale(g, scale) for g in grads]
        optimizer.apply(grads, variables)

    strategy.run(step, args=(values,))
    return training.values_of(variables), optimizer


@pytest.mark.parametrize("planted", [None, np.inf], ids=["finite", "inf"])
def test_two_replicas_apply_or_skip_large_gradients_together(planted):
    scale = 2.0 ** 10
    per_replica = [_scaled_gradients(scale, seed=0),
                   _scaled_gradients(scale, seed=1, planted=planted)]
    applied, optimizer = _mirrored_step(
        lambda: tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(_LEARNING_RATE),
            loss_scale=tf_lossscale.DynamicLossScale(scale)),
        per_replica, unscale_first=False, scale=scale)
    if planted is None:
        expected, _ = _mirrored_step(
            lambda: keras.optimizers.SGD(_LEARNING_RATE), per_replica,
            unscale_first=True, scale=scale)
        assert int(optimizer.skipped_steps) == 0
    else:
        expected = training.values_of(_variables())
        assert int(optimizer.skipped_steps) == 1
    _assert_same_values(applied, expected)


@pytest.mark.parametrize("mode", ["tf_function", "xla"])
@pytest.mark.parametrize("planted", [None, np.nan], ids=["finite", "nan"])
def test_tf_keras_wrapper_applies_or_skips_large_gradients_exactly(
        planted, mode):
    scale = tf_lossscale.DynamicLossScale(2.0 ** 12)
    scaled = _scaled_gradients(2.0 ** 12, planted=planted)
    variables = _variables()
    optimizer = tf_lossscale.LossScaleOptimizer(
        tf_keras.optimizers.SGD(_LEARNING_RATE), loss_scale=scale)

    def step():
        optimizer.scale_loss(tf.constant(1.0))  # Scaled gradients follow.
        optimizer.apply_gradients(zip(scaled, variables))

    _run(step, mode)
    if planted is None:
        expected = _divided_first(tf_lossscale.DynamicLossScale(2.0 ** 12),
                                  scaled, mode, tf_keras.optimizers)
    else:
        expected = training.values_of(_variables())
    assert int(optimizer.skipped_steps) == (planted is not None)
    _assert_same_values(training.values_of(variables), expected)

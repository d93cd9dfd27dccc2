"""Our TF1 wrapper against TensorFlow's, step by step.

The promise: `tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer` with a
`tf_lossscale.DynamicLossScale` leaves the same weights, optimizer slots,
global step, loss scale and good-step count, bit for bit, as
`tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer` with
TensorFlow's own `DynamicLossScale` of the same parameters, after every step
of a random sequence of finite, overflowing and non-finite batches, for
GradientDescent, Momentum and Adam; in a TF1 graph run by a Session and
eagerly.

The model computes in float16 (tf1_graphs), so its gradients also overflow
when the scale is too high, as in real mixed precision. Scales stay powers of
two: TensorFlow's wrapper multiplies the gradients by 1/scale where ours
divides by the scale, which agree bit for bit exactly for powers of two.

Sequences are seeded: a failure names its optimizer, parameters and seed.
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import reference_oracle as oracle
from tests.helpers import tf1_graphs
import tf_lossscale

SEED = 20_261_124

OPTIMIZERS = {
    "gradient_descent":
        lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01),
}

# (initial_loss_scale, increment_period, multiplier). 2**20 does not fit in
# float16: the scaled loss is infinite until the scale has backed off. 0.5
# backs off to the floor of 1.
PARAMS = [(2.0**15, 1, 2.0), (2.0**12, 2, 2.0), (1.0, 3, 4.0),
          (2.0**20, 2, 2.0), (0.5, 1, 2.0)]

GRAPH_STEPS = 40
EAGER_STEPS = 12

_KINDS = ("finite", "large", "nan", "inf", "-inf")
_KIND_WEIGHTS = (0.5, 0.25, 0.1, 0.1, 0.05)


def _kinds(rng, steps):
    return list(rng.choice(_KINDS, size=steps, p=_KIND_WEIGHTS))


def _wrappers(optimizer, params):
    """Factories of (ours, TensorFlow's) for use inside a graph."""
    make_inner = OPTIMIZERS[optimizer]
    ours = lambda: tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer(  # pylint: disable=unnecessary-lambda-assignment
        make_inner(), tf_lossscale.DynamicLossScale(*params))
    theirs = lambda: (  # pylint: disable=unnecessary-lambda-assignment
        tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
            make_inner(), oracle.reference_dynamic(*params)))
    return ours, theirs


def _assert_same_sequences(ours, theirs, context):
    for step, (a, e) in enumerate(zip(ours, theirs)):
        try:
            tf1_graphs.assert_same_state(a, e)
        except AssertionError as error:
            raise AssertionError(f"{context}, step {step}: {error}") from None


GRAPH_CASES = list(itertools.product(OPTIMIZERS, range(len(PARAMS))))


@pytest.mark.parametrize("optimizer, case", GRAPH_CASES)
def test_same_state_as_tensorflows_wrapper_in_a_session(optimizer, case):
    params, seed = PARAMS[case], SEED + case
    kinds = _kinds(np.random.default_rng(seed), GRAPH_STEPS)
    ours, theirs = (
        tf1_graphs.run_steps(tf1_graphs.TrainGraph(make), kinds, seed=seed)
        for make in _wrappers(optimizer, params))
    ours = list(ours)
    _assert_same_sequences(ours, list(theirs),
                           f"{optimizer}, params {params}, seed {seed}")
    # The sequence exercised both branches.
    applied = int(ours[-1]["global_step"])
    assert 0 < applied < GRAPH_STEPS


def _eager_states(make_optimizer, kinds, seed):
    kernel, bias = (tf.Variable(value)
                    for value in tf1_graphs.initial_values())
    global_step = tf.Variable(0, dtype=tf.int64)
    optimizer = make_optimizer()
    inner = optimizer._optimizer  # pylint: disable=protected-access
    rng = np.random.default_rng(seed)
    states = []
    for kind in kinds:
        inputs = tf.constant(tf1_graphs.feed(kind, rng))
        optimizer.minimize(
            lambda: tf1_graphs.model_loss(kernel, bias, inputs),  # pylint: disable=cell-var-from-loop
            var_list=[kernel, bias], global_step=global_step)
        states.append({
            "weights": [kernel.numpy(), bias.numpy()],
            "global_step": global_step.numpy(),
            "inner_variables": [v.numpy() for v in inner.variables()],
            "loss_scale_variables": [
                v.numpy() for v in optimizer.variables()[
                    len(inner.variables()):]],
            "scale": optimizer._loss_scale().numpy(),  # pylint: disable=protected-access
        })
    return states


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_same_state_as_tensorflows_wrapper_eagerly(optimizer):
    params, seed = PARAMS[1], SEED + 100
    kinds = _kinds(np.random.default_rng(seed), EAGER_STEPS)
    ours, theirs = (_eager_states(make, kinds, seed)
                    for make in _wrappers(optimizer, params))
    _assert_same_sequences(list(ours), list(theirs),
                           f"eager {optimizer}, params {params}, seed {seed}")

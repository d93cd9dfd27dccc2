"""`tf_lossscale.LossScaleOptimizer` with `model.compile` / `model.fit`.

Covers the three ways `fit` runs a step on one device (eagerly, in a
`tf.function`, XLA-compiled) under the `mixed_float16` policy, and
`MirroredStrategy` over two logical CPUs (conftest.py splits the CPU), where a
NaN can appear in one replica's part of the batch only.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
from tests.helpers import models
from tests.helpers import reference_oracle as oracle
from tests.helpers.training import values_of
import tf_lossscale
from tf_lossscale import LossScaleOptimizer

_NAN = float("nan")
_REPLICA_DEVICES = ["/cpu:0", "/cpu:1"]
_BATCH_SIZE = 8


pytestmark = pytest.mark.usefixtures("keras_isolation")


def _sgd():
    # Not Adam: its first step hardly depends on the gradients' magnitude,
    # so it would hide gradients that are not unscaled.
    return keras.optimizers.SGD(0.1, momentum=0.9)


def _fit_one_batch(model, x, y):
    # Under XLA the loss scale's checks run on the host (XlaChecks); without
    # XLA the callback does nothing.
    callbacks = ([tf_lossscale.XlaChecks()]
                 if isinstance(model.optimizer, LossScaleOptimizer) else [])
    model.fit(x, y, batch_size=_BATCH_SIZE, epochs=1, shuffle=False,
              verbose=0, callbacks=callbacks)


def test_compile_under_mixed_float16_keeps_our_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    plain = keras.optimizers.SGD()
    model, plain_model = models.tiny_model(), models.tiny_model()

    model.compile(optimizer=optimizer, loss="mse")
    plain_model.compile(optimizer=plain, loss="mse")

    # Keras wraps any optimizer that is not its LossScaleOptimizer; wrapping
    # ours would scale the loss twice.
    assert model.optimizer is optimizer
    assert isinstance(plain_model.optimizer,
                      keras.optimizers.LossScaleOptimizer)
    assert not isinstance(plain_model.optimizer, LossScaleOptimizer)
    assert plain_model.optimizer.inner_optimizer is plain


@pytest.mark.parametrize("compile_args", [
    {"run_eagerly": True},
    {},
    {"jit_compile": True},
    {"jit_compile": True, "steps_per_execution": 2},
], ids=["eager", "tf_function", "jit_compile", "jit_compile_2_steps_per_call"])
def test_mixed_float16_fit_matches_float32_and_skips_non_finite_batch(
        compile_args):
    loss_scale_config = {"initial_loss_scale": 2.0**8,
                         "increment_period": 2, "multiplier": 2.0}
    x, y = training.normal_data(_BATCH_SIZE)
    keras.mixed_precision.set_global_policy("float32")
    float32_model = models.tiny_model()
    initial_weights = values_of(float32_model.weights)
    float32_model.compile(_sgd(), "mse", **compile_args)
    _fit_one_batch(float32_model, x, y)
    float32_update = [w.numpy() - w0 for w, w0 in
                      zip(float32_model.weights, initial_weights)]

    keras.mixed_precision.set_global_policy("mixed_float16")
    model = models.tiny_model()
    optimizer = LossScaleOptimizer(
        _sgd(), tf_lossscale.DynamicLossScale(**loss_scale_config))
    model.compile(optimizer, "mse", **compile_args)
    _fit_one_batch(model, x, y)

    # float16 keeps about three significant digits; a step that was skipped,
    # not unscaled or unscaled twice is off by 100% or more.
    for w, w0, expected in zip(model.weights, initial_weights,
                               float32_update):
        np.testing.assert_allclose(
            w.numpy() - w0, expected, rtol=1e-2,
            atol=1e-2 * np.abs(expected).max())
    assert int(optimizer.iterations.numpy()) == 1
    assert int(optimizer.skipped_steps) == 0

    weights = values_of(model.weights)
    slots = values_of(optimizer.inner_optimizer.variables)
    x_nan = x.copy()
    x_nan[3, 1] = _NAN
    _fit_one_batch(model, x_nan, y)

    state = model.weights + optimizer.inner_optimizer.variables
    for variable, before in zip(state, weights + slots):
        np.testing.assert_array_equal(variable.numpy(), before)
    assert int(optimizer.iterations.numpy()) == 1
    assert int(optimizer.skipped_steps) == 1
    assert float(optimizer.loss_scale()) == oracle.reference_scales(
        [True, False], **loss_scale_config)[-1]


# ---------------------------------------------------------------------------
# MirroredStrategy on two logical CPUs.


def _replica_parts(strategy, x):
    """How the strategy splits a global batch between its replicas."""
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(_BATCH_SIZE)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    return [p.numpy() for p in strategy.experimental_local_results(batch)]


def _local_values(strategy, variable):
    return [v.numpy() for v in strategy.experimental_local_results(
        variable.value)]


def _poisoned_batch(strategy, nan_replica):
    """A batch whose NaN only `nan_replica` sees."""
    x, y = training.normal_data(_BATCH_SIZE, seed=1)
    x[_BATCH_SIZE // 2 * nan_replica + 1, 0] = _NAN
    parts = _replica_parts(strategy, x)
    assert [np.isnan(p).any() for p in parts] == [
        r == nan_replica for r in range(len(parts))]
    return x, y


def _compiled_mirrored_model(strategy, make_optimizer):
    with strategy.scope():
        model = models.tiny_model()
        optimizer = make_optimizer()
        model.compile(optimizer, "mse")
    return model, optimizer


_POISONED_CONFIG = {"initial_loss_scale": 8.0, "increment_period": 3,
                    "multiplier": 2.0}


@pytest.fixture(scope="module")
def poisoned_mirrored_steps():
    """{nan_replica: what a step did whose NaN only that replica saw}: one
    mixed_float16 model on two replicas, compiled once, takes a finite
    step, then a batch poisoned on replica 0, then one poisoned on
    replica 1. For each: the replicas' copies of the weights and slots
    before and after, and the optimizer's iterations, skipped steps and
    scale after."""
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        strategy = training.mirrored(len(_REPLICA_DEVICES))
        model, optimizer = _compiled_mirrored_model(
            strategy, lambda: LossScaleOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.9),
                tf_lossscale.DynamicLossScale(**_POISONED_CONFIG)))
        _fit_one_batch(model, *training.normal_data(_BATCH_SIZE))
        state = model.weights + optimizer.inner_optimizer.variables
        steps = {}
        for nan_replica in range(len(_REPLICA_DEVICES)):
            x, y = _poisoned_batch(strategy, nan_replica)
            before = [_local_values(strategy, v) for v in state]
            _fit_one_batch(model, x, y)
            steps[nan_replica] = {
                "paths": [v.path for v in state],
                "before": before,
                "after": [_local_values(strategy, v) for v in state],
                "iterations": int(optimizer.iterations.numpy()),
                "skipped_steps": int(optimizer.skipped_steps),
                "scale": float(optimizer.loss_scale()),
            }
        return steps
    finally:
        keras.mixed_precision.set_global_policy(policy)


# One xdist worker runs both cases: the fixture runs once.
@pytest.mark.xdist_group("keras_fit_poisoned_mirrored")
@pytest.mark.parametrize("nan_replica", [0, 1])
def test_nan_on_one_replica_skips_the_step_on_all_replicas(
        poisoned_mirrored_steps, nan_replica):
    step = poisoned_mirrored_steps[nan_replica]

    for path, old_copies, copies in zip(step["paths"], step["before"],
                                        step["after"]):
        assert len(copies) == len(_REPLICA_DEVICES)
        for copy, old_copy in zip(copies, old_copies):
            assert np.isfinite(copy).all(), path
            np.testing.assert_array_equal(copy, old_copy, err_msg=path)
            np.testing.assert_array_equal(copy, copies[0], err_msg=path)
    # The finite first step only; each poisoned step skipped once, backing
    # the scale off as TensorFlow's rule does.
    assert step["iterations"] == 1
    assert step["skipped_steps"] == 1 + nan_replica
    assert step["scale"] == oracle.reference_scales(
        [True] + [False] * (1 + nan_replica), **_POISONED_CONFIG)[-1]


def test_keras_own_loss_scale_optimizer_misses_nan_on_replica_one():
    """Why this library exists: Keras 3.15 checks replica 0's gradients only.

    The same step as above with `keras.mixed_precision.LossScaleOptimizer`
    is applied: the NaN reaches the weights and the scale does not back off.
    Should a Keras release fix this, this test fails and the README's claim
    needs revisiting.
    """
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = training.mirrored(len(_REPLICA_DEVICES))
    model, optimizer = _compiled_mirrored_model(
        strategy, lambda: keras.mixed_precision.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=8.0,
            dynamic_growth_steps=3))
    _fit_one_batch(model, *training.normal_data(_BATCH_SIZE))
    scale = float(optimizer.dynamic_scale.numpy())
    x, y = _poisoned_batch(strategy, nan_replica=1)

    _fit_one_batch(model, x, y)

    kernel_copies = _local_values(strategy, model.weights[0])
    assert all(np.isnan(copy).any() for copy in kernel_copies)
    assert float(optimizer.dynamic_scale.numpy()) >= scale
    assert int(optimizer.iterations.numpy()) == 2


def test_finite_fit_step_under_mirrored_strategy_matches_one_device():
    x, y = training.normal_data(_BATCH_SIZE)

    def make_optimizer():
        return LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                  loss_scale="dynamic")

    strategy = training.mirrored(len(_REPLICA_DEVICES))
    mirrored_model, _ = _compiled_mirrored_model(strategy, make_optimizer)
    single_model = models.tiny_model()
    single_model.compile(make_optimizer(), "mse")

    for _ in range(2):
        _fit_one_batch(mirrored_model, x, y)
        _fit_one_batch(single_model, x, y)

    for mirrored, single in zip(mirrored_model.weights, single_model.weights):
        for copy in _local_values(strategy, mirrored):
            np.testing.assert_allclose(copy, single.numpy(), rtol=1e-6,
                                       atol=1e-7)


def test_apply_gradients_outside_replica_context_is_an_error():
    strategy = training.mirrored(len(_REPLICA_DEVICES))
    with strategy.scope():
        variable = tf.Variable([1.0, 2.0])
        optimizer = LossScaleOptimizer(keras.optimizers.SGD())

        with pytest.raises(RuntimeError, match="replica context"):
            optimizer.apply_gradients([(tf.constant([1.0, 1.0]), variable)])

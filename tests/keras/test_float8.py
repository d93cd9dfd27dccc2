"""float8 training: `*_scale` and `*_amax_history` take their gradient as is.

`model.quantize("float8")` gives Dense layers variables with
`overwrite_with_gradient = True`: the optimizer writes their "gradient" into
them. Those gradients are computed from the scaled loss and Keras' own
`LossScaleOptimizer` passes them through without unscaling; so must ours, in
the Keras 3 protocol (`scale_loss`, then `apply_gradients`), or the float8
scaling factors come out `scale` times too small.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

pytestmark = pytest.mark.usefixtures("keras_isolation")

_SCALE = 1024.0
_STEPS = 3


def _float8_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)])
    model.quantize("float8")
    return model


def _train(wrap, inputs, targets, compile_args):
    model = _float8_model()
    optimizer = wrap(keras.optimizers.SGD(0.01))
    model.compile(optimizer=optimizer, loss="mse", **compile_args)
    callbacks = ([tf_lossscale.XlaChecks()] if isinstance(
        optimizer, tf_lossscale.LossScaleOptimizer) else [])
    model.fit(inputs, targets, batch_size=8, epochs=1, shuffle=False,
              verbose=0, callbacks=callbacks)
    return model


_COMPILE = {
    "graph": {"jit_compile": False},
    "xla": {"jit_compile": True},
    "xla_2_steps_per_call": {"jit_compile": True, "steps_per_execution": 2},
}


@pytest.mark.parametrize("mode", _COMPILE)
def test_float8_variables_match_keras_loss_scale_optimizer(mode):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(8 * _STEPS, 8)).astype(np.float32)
    targets = rng.normal(size=(8 * _STEPS, 4)).astype(np.float32)
    # The same scale on every step for both: growth is far away.
    ours = _train(lambda inner: tf_lossscale.LossScaleOptimizer(
        inner, initial_scale=_SCALE, dynamic_growth_steps=1000),
        inputs, targets, _COMPILE[mode])
    # Keras' own wrapper, compiled the same way, in the same run.
    keras_own = _train(lambda inner: keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=_SCALE, dynamic_growth_steps=1000),
        inputs, targets, _COMPILE[mode])

    overwritten = [v for v in ours.trainable_variables
                   if getattr(v, "overwrite_with_gradient", False)]
    assert {v.path.rsplit("/", 1)[-1] for v in overwritten} >= {
        "outputs_grad_scale", "outputs_grad_amax_history"}
    for mine, theirs in zip(ours.trainable_variables,
                            keras_own.trainable_variables):
        assert mine.name == theirs.name
        if mode == "graph":
            np.testing.assert_array_equal(mine.numpy(), theirs.numpy(),
                                          err_msg=mine.path)
        else:
            # The two wrappers' steps are different programs, and XLA may
            # fuse each one's reductions in another order (TF 2.16's XLA
            # does: one float32 ulp apart); the values agree to within that.
            np.testing.assert_allclose(mine.numpy(), theirs.numpy(),
                                       rtol=1e-6, atol=0, err_msg=mine.path)
    # The upstream-gradient history holds scaled values: passing it through
    # is visible (unscaling would have divided it by the scale).
    history = [v for v in overwritten
               if v.name == "outputs_grad_amax_history"][-1]
    assert np.max(history.numpy()) > 1.0
    assert float(ours.optimizer.loss_scale()) == _SCALE


@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_float8_gradients_count_in_the_finiteness_check(mode):
    model = _float8_model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), loss_scale=tf_lossscale.DynamicLossScale(
            _SCALE, increment_period=1000))
    variables = model.trainable_variables
    optimizer.build(variables)
    before = [v.numpy() for v in variables]
    grads = [tf.zeros_like(v) for v in variables]
    history = next(i for i, v in enumerate(variables)
                   if v.name == "inputs_amax_history")
    grads[history] = tf.tensor_scatter_nd_update(
        grads[history], [[3]], [float("nan")])
    def step(grads):
        optimizer.scale_loss(tf.constant(1.0))
        optimizer.apply(grads, variables)

    if mode == "xla":
        step = tf_lossscale.with_xla_checks(
            tf.function(step, jit_compile=True), optimizer)
    step(grads)
    assert int(optimizer.skipped_steps) == 1
    for variable, value in zip(variables, before):
        np.testing.assert_array_equal(variable.numpy(), value)
    assert optimizer.last_nonfinite_variables() == [variables[history].path]

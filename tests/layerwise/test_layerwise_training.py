"""Training a model scaled per layer: what a loss scale already does holds
(the single-scale wrapper when every factor is 1; skipped steps and their
record; the failure policy; the monitor; XLA), and the low layers of a model
no single scale fits learn as in float32."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale import layerwise
from tests.helpers import layerwise_models as models
from tests.helpers.training import values_of

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _fit(model, x, y, callbacks=(), **kwargs):
    return model.fit(x, y, batch_size=models.BATCH, shuffle=False,
                     verbose=0, callbacks=list(callbacks), **kwargs)


def _optimizer_state(model):
    """The inner optimizer's variables (its slots, its iterations)."""
    return values_of(model.optimizer.inner_optimizer.variables)


def test_with_every_factor_one_it_is_the_single_scale_wrapper_bit_for_bit():
    x, y = models.data(batches=6, nan_batches=[2])
    loss_scale = tf_lossscale.DynamicLossScale(2.0**10, increment_period=2)
    single = models.gained_model(log2_gain=-6, loss_scale=loss_scale)
    scaled = layerwise.scale_per_layer(
        models.gained_model(log2_gain=-6, loss_scale=loss_scale),
        min_factor=1, max_factor=1)

    _fit(single, x, y)
    _fit(scaled, x, y)

    for ours, theirs in zip(values_of(scaled.trainable_variables),
                            values_of(single.trainable_variables)):
        np.testing.assert_array_equal(ours, theirs)
    for ours, theirs in zip(_optimizer_state(scaled),
                            _optimizer_state(single)):
        np.testing.assert_array_equal(ours, theirs)
    assert float(scaled.optimizer.loss_scale()) == float(
        single.optimizer.loss_scale())
    assert int(scaled.optimizer.skipped_steps) == 1
    assert scaled.gradient_factors() == dict.fromkeys(
        ["low_1", "low_2", "high", "head"], 1.0)


def _unscaled_gradients(model, x, y):
    """The gradients `model`'s optimizer hands its inner optimizer: each
    unscaled by its segment's S * F (by S for a model of one segment)."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
        scaled_loss = model.optimizer.scale_loss(loss)
    grads = tape.gradient(scaled_loss, model.trainable_variables)
    scale = float(model.optimizer.loss_scale())
    factors = getattr(model, "gradient_factors", dict)()
    divisor = {id(v): scale * factors.get(layer.name, 1.0)
               for layer in model.layers for v in layer.trainable_weights}
    return {v.path: g.numpy() / divisor[id(v)]
            for g, v in zip(grads, model.trainable_variables)}


def test_low_layers_no_single_scale_fits_get_their_float32_gradients():
    x, y = models.data(batches=4)
    scaled = layerwise.scale_per_layer(models.gained_model())
    _fit(scaled, x, y)  # The factors align.
    keras.mixed_precision.set_global_policy("float32")
    float32, single = models.gained_model("float32"), models.gained_model()
    for model in (float32, single):
        for layer in model.layers:
            if layer.weights:
                layer.set_weights(scaled.get_layer(layer.name).get_weights())

    grads = {name: _unscaled_gradients(model, x, y) for name, model in
             (("float32", float32), ("single", single), ("scaled", scaled))}

    for path, want in grads["float32"].items():
        error = np.linalg.norm(grads["scaled"][path] - want) / np.linalg.norm(
            want)
        # float16's precision, every layer alike.
        assert error < 0.02, (path, error)
        if path.startswith("low"):
            # Below 2**-40 of the head's: 0 in float16 at any single scale.
            assert not np.any(grads["single"][path]), path
    factors = scaled.gradient_factors()
    assert min(factors["low_1"], factors["low_2"]) >= 2.0**30, factors


def test_a_non_finite_step_is_skipped_and_recorded_leaving_every_variable():
    x, y = models.data(batches=2, nan_batches=[1])
    scaled = layerwise.scale_per_layer(models.gained_model())
    scaled.train_on_batch(x[:models.BATCH], y[:models.BATCH])
    weights, slots = values_of(scaled.weights), _optimizer_state(scaled)
    factors = scaled.gradient_factors()
    scale = float(scaled.optimizer.loss_scale())

    scaled.train_on_batch(x[models.BATCH:], y[models.BATCH:])

    for now, then in zip(values_of(scaled.weights), weights):
        np.testing.assert_array_equal(now, then)
    for now, then in zip(_optimizer_state(scaled), slots):
        np.testing.assert_array_equal(now, then)
    assert int(scaled.optimizer.skipped_steps) == 1
    assert scaled.optimizer.last_nonfinite_variables() == [
        v.path for v in scaled.trainable_variables]
    # A NaN in the inputs reaches the top first: the loss scale backs off,
    # every factor is kept.
    assert float(scaled.optimizer.loss_scale()) == scale / 2
    assert scaled.gradient_factors() == factors


def test_an_overflow_below_the_top_backs_off_that_segment_alone():
    x, y = models.data(batches=1)
    scaled = layerwise.scale_per_layer(models.gained_model(log2_gain=0))
    state = scaled.non_trainable_weights
    factors, margins = state[0], state[1]
    # Far too high for low_1: its gradients overflow float16, nothing above.
    factors.assign([2.0**30, 1.0, 1.0])
    weights = values_of(scaled.trainable_variables)
    scale = float(scaled.optimizer.loss_scale())

    scaled.train_on_batch(x, y)

    assert int(scaled.optimizer.skipped_steps) == 1
    assert float(scaled.optimizer.loss_scale()) == scale
    np.testing.assert_array_equal(factors.numpy(), [2.0**29, 1.0, 1.0])
    np.testing.assert_array_equal(margins.numpy(), [0.5, 1.0, 1.0])
    for now, then in zip(values_of(scaled.trainable_variables), weights):
        np.testing.assert_array_equal(now, then)


def test_a_segment_that_cannot_back_off_hands_the_failure_to_the_loss_scale():
    x, y = models.data(batches=4)
    model = models.gained_model(
        log2_gain=0, loss_scale=tf_lossscale.DynamicLossScale(
            4, min_loss_scale=1, on_min_loss_scale="raise"))
    # Factors pinned far too high: low_1 overflows at every scale.
    scaled = layerwise.scale_per_layer(model, min_factor=2.0**40,
                                       max_factor=2.0**40)

    weights = values_of(scaled.trainable_variables)

    with pytest.raises(tf.errors.InvalidArgumentError, match="min_loss_scale"):
        _fit(scaled, x, y)
    assert float(scaled.optimizer.loss_scale()) == 1.0
    for now, then in zip(values_of(scaled.trainable_variables), weights):
        np.testing.assert_array_equal(now, then)


def test_the_monitor_logs_each_segments_factor():
    x, y = models.data(batches=3)
    scaled = layerwise.scale_per_layer(models.gained_model())

    history = _fit(scaled, x, y, [tf_lossscale.LossScaleMonitor()],
                   epochs=2)

    factors = scaled.gradient_factors()
    for name, value in factors.items():
        assert history.history[f"gradient_factor/{name}"][-1] == value
    assert history.history["gradient_factor/low_1"][0] >= 2.0**30


def test_the_monitors_gradient_statistics_measure_each_segment_at_its_scale():
    x, y = models.data(batches=3)
    scaled = layerwise.scale_per_layer(models.gained_model())

    history = _fit(scaled, x, y, [tf_lossscale.LossScaleMonitor(
        gradient_stats=True)], epochs=2)

    # low_1 and low_2 hold 112 of the 184 float16 values: measured at the
    # loss scale alone, all of them would be 0 in float16.
    assert history.history["grad_underflow_share"][-1] < 0.05, history.history


def test_under_xla_factors_align_and_a_non_finite_step_is_skipped():
    x, y = models.data(batches=4, nan_batches=[3])
    scaled = layerwise.scale_per_layer(models.gained_model(jit_compile=True))
    _fit(scaled, x[:3 * models.BATCH], y[:3 * models.BATCH],
         [tf_lossscale.XlaChecks()])
    weights = values_of(scaled.weights)

    _fit(scaled, x[3 * models.BATCH:], y[3 * models.BATCH:],
         [tf_lossscale.XlaChecks()])

    assert int(scaled.optimizer.skipped_steps) == 1
    for now, then in zip(values_of(scaled.weights), weights):
        np.testing.assert_array_equal(now, then)
    factors = scaled.gradient_factors()
    assert min(factors["low_1"], factors["low_2"]) >= 2.0**30, factors


def test_the_last_segments_factor_is_one():
    # "the last segment's is 1": the top is scaled by S alone.
    x, y = models.data(batches=3)
    scaled = layerwise.scale_per_layer(models.gained_model())
    history = scaled.fit(x, y, batch_size=models.BATCH, shuffle=False,
                         verbose=0, epochs=2,
                         callbacks=[tf_lossscale.LossScaleMonitor()])
    top = scaled.segments[-1][0]
    factors = scaled.gradient_factors()
    assert list(factors) == [names[0] for names in scaled.segments]
    assert factors[top] == 1.0
    assert history.history[f"gradient_factor/{top}"] == [1.0, 1.0]
    assert max(factors.values()) > 1.0  # The others moved.

"""`FailureWatch` over a model scaled per layer
(`tf_lossscale.layerwise.scale_per_layer`), in a custom loop and in
`FailureWatch.fit`: the watch reads the loss scale as for any model, the
report names the layer, and `report.fix(model)` keeps the per-layer
scaling with its state (factors, margins, good steps) and the
optimizer's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests.helpers import late_failures as late
from tf_lossscale import layerwise

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_layerwise")]

GROWTH = 4.0  # The logits' bias, times this after each step.


def _model():
    model = late.two_layer_classifier(keras)
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9),
        loss_scale=tf_lossscale.DynamicLossScale(1024.0, 1000)),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    scaled = layerwise.scale_per_layer(model)
    scaled.get_layer("logits").bias.assign([1.0, -1.0])
    return scaled


def _step_function(model):
    optimizer = model.optimizer

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def _batch():
    return late.two_layer_data(8)


@pytest.fixture(scope="module")
def failed():
    model = _model()
    x, y = _batch()
    watch = tf_lossscale.FailureWatch([(x, y)], steps=1, settle_steps=3,
                                      max_consecutive_skips=3)
    step = _step_function(model)
    bias = model.get_layer("logits").bias
    with pytest.raises(tf_lossscale.Float16FailureError) as raised:
        for _ in range(40):
            loss = step(x, y)
            bias.assign(bias * GROWTH)
            watch.after_step(model, loss)
    return model, raised.value.report


def test_the_watch_names_the_layer_of_a_model_scaled_per_layer(failed):
    model, report = failed
    assert isinstance(model, layerwise.LayerwiseModel)
    assert report.diagnosis.first_nonfinite_layer == "logits"
    assert report.step == int(model.optimizer.iterations) + int(
        model.optimizer.skipped_steps)
    assert "'logits'" in str(report)


def test_fix_keeps_the_per_layer_scaling_and_its_state(failed):
    model, report = failed
    fixed = report.fix(model)
    assert isinstance(fixed, layerwise.LayerwiseModel)
    assert fixed.get_layer("logits").compute_dtype == "float32"
    assert fixed.gradient_factors() == model.gradient_factors()
    # The factors' state (factors, margins, good steps) are the model's
    # non-trainable weights; the good steps count on.
    state = [w for w in model.weights if not w.trainable]
    assert state
    for source, target in zip(state, [w for w in fixed.weights
                                      if not w.trainable]):
        np.testing.assert_array_equal(target.numpy(), source.numpy())
    assert any(np.any(w.numpy() > 0) for w in state
               if "good_steps" in w.name)
    old, new = model.optimizer, fixed.optimizer
    assert new._gradient_scaling is not None  # Its steps are segmented.
    assert int(new.iterations) == int(old.iterations)
    assert int(new.skipped_steps) == int(old.skipped_steps)
    for source, target in zip(old.inner_optimizer.variables,
                              new.inner_optimizer.variables):
        np.testing.assert_array_equal(target.numpy(), source.numpy())
    assert float(new.loss_scale()) == report.settled_scale


def test_the_loop_goes_on_with_the_fixed_model(failed):
    model, report = failed
    fixed = report.fix(model)
    step = _step_function(fixed)
    x, y = _batch()
    skipped, iterations = (int(fixed.optimizer.skipped_steps),
                           int(fixed.optimizer.iterations))
    losses = [float(step(x, y)) for _ in range(4)]
    assert np.all(np.isfinite(losses))
    assert int(fixed.optimizer.skipped_steps) == skipped
    assert int(fixed.optimizer.iterations) == iterations + 4


def test_watch_fit_carries_a_model_scaled_per_layer_on():
    # The late failure of tests/watch/test_late_failures.py, its
    # classifier scaled per layer, trained by `fit`.
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = late.logits_classifier(keras)
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.Lion(0.12)),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    model = layerwise.scale_per_layer(model)
    x, y = late.separable_data()
    watch = tf_lossscale.FailureWatch([(x[:late.BATCH], y[:late.BATCH])],
                                      on_failure="fix", steps=1,
                                      verbose=False)
    history = watch.fit(model, x, y, batch_size=late.BATCH, epochs=22,
                        shuffle=False, verbose=0)
    (report,) = watch.reports
    assert report.diagnosis.first_nonfinite_layer == "logits"
    fixed = history.model
    assert isinstance(fixed, layerwise.LayerwiseModel)
    assert fixed.get_layer("logits").compute_dtype == "float32"
    assert set(fixed.gradient_factors()) == set(model.gradient_factors())
    assert int(fixed.optimizer.iterations) > int(model.optimizer.iterations)
    assert np.all(np.isfinite(history.history["loss"]))

"""The host side of the XLA checks (`tf_lossscale.loss_scales.xla_checks`).

Under XLA (`jit_compile=True`) a compiled step cannot raise or print: it
records what the failure policy asks for, and the host acts on the record
after the call, with the same error or warning as without XLA. These tests
pin who acts (`with_xla_checks`, the `XlaChecks` and `LossScaleMonitor`
callbacks), when (after each call, with the latest values; steps after a
failure in the same call change nothing), that the record is cleared so
training resumes, and that a step whose checks nobody would carry out fails
before it runs, naming the fix. The policy itself, in every mode:
`tests/step/test_failure_policy.py`; how often the host reads the record:
`tests/xla/test_xla_record.py`; every way of running an XLA step:
`tests/xla/test_xla_ways.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
from tests.helpers import models
from tests.helpers import policy_runs as runs
import tf_lossscale

_NAN = float("nan")
_WARNING = "tf_lossscale WARNING:"


@pytest.mark.usefixtures("keras_isolation")
def test_fit_under_xla_warns_once_per_call_with_the_latest_values(capfd):
    # Two steps per call, three steps at the floor: the first call's two
    # warnings come as one line with the second's values.
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=1, on_min_loss_scale="warn")
    model, optimizer = runs.compiled(loss_scale,
                                     runs.FIT_MODES["xla_2_steps_per_call"])
    capfd.readouterr()
    runs.fit(model, *runs.nan_batches(3))
    lines = [line for line in capfd.readouterr().err.splitlines()
             if line.startswith(_WARNING)]
    assert len(lines) == 2, lines
    assert "min_loss_scale=1.0" in lines[0] and "current scale 1" in lines[0]
    assert "non-finite gradients: 2 (the last of 2 such steps" in lines[0]
    assert lines[1].endswith("non-finite gradients: 3")
    assert int(optimizer.skipped_steps) == 3


@pytest.mark.usefixtures("keras_isolation")
def test_train_on_batch_under_xla_with_xla_checks_carries_out_the_limit():
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=1, max_consecutive_skips=2)
    model, optimizer = runs.compiled(loss_scale, runs.FIT_MODES["xla"])
    train_on_batch = tf_lossscale.with_xla_checks(model.train_on_batch,
                                                  optimizer)
    x, y = runs.nan_batches(1)
    train_on_batch(x, y)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"in a row for non-finite gradients: 2\b"):
        train_on_batch(x, y)
    assert runs.scale_state(loss_scale)["consecutive_skips"] == 2
    assert int(optimizer.iterations.numpy()) == 0


@pytest.mark.usefixtures("keras_isolation")
@pytest.mark.parametrize("host", ["XlaChecks", "LossScaleMonitor"])
def test_fit_under_xla_raises_with_either_callback(host):
    loss_scale = tf_lossscale.DynamicLossScale(max_consecutive_skips=2)
    model, optimizer = runs.compiled(loss_scale, runs.FIT_MODES["xla"])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"in a row for non-finite gradients: 2\b"):
        model.fit(*runs.nan_batches(4), batch_size=runs.BATCH_SIZE,
                  shuffle=False, verbose=0,
                  callbacks=[getattr(tf_lossscale, host)()])
    assert runs.scale_state(loss_scale)["consecutive_skips"] == 2
    assert int(optimizer.skipped_steps) == 1


@pytest.mark.usefixtures("keras_isolation")
def test_later_watched_fits_still_raise_and_resume_after_the_error():
    # Each fit with XlaChecks traces its step under its own watch (the
    # previous one's ended with that fit); all are checked after every call.
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=1, on_min_loss_scale="raise")
    model, optimizer = runs.compiled(loss_scale, runs.FIT_MODES["xla"])
    x, y = training.normal_data(runs.BATCH_SIZE)
    runs.fit(model, x, y)
    weights = [w.numpy() for w in model.weights]
    x_nan = np.concatenate([x, x])
    x_nan[0, 0] = _NAN
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"min_loss_scale=1\.0"):
        runs.fit(model, x_nan, np.concatenate([y, y]))
    for weight, before in zip(model.weights, weights):
        np.testing.assert_array_equal(weight.numpy(), before)
    assert int(optimizer.iterations.numpy()) == 1
    runs.fit(model, x, y)  # The record was cleared: training resumes.
    assert int(optimizer.iterations.numpy()) == 2


@pytest.mark.usefixtures("keras_isolation")
def test_custom_xla_step_of_two_steps_raises_after_the_call_unchanged():
    # A custom loop's XLA function running two optimizer steps per call:
    # NaN at the floor, then a finite batch the failure keeps from applying.
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = models.tiny_model()
    loss_scale = tf_lossscale.DynamicLossScale(
        initial_loss_scale=1, on_min_loss_scale="raise")
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=loss_scale)
    optimizer.build(model.trainable_variables)

    def one_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(
                tf.cast(model(x), tf.float32) - y))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    def two_steps(x_first, x_second, y):
        one_step(x_first, y)
        one_step(x_second, y)

    x, y = training.normal_data(runs.BATCH_SIZE)
    x_nan = x.copy()
    x_nan[0, 0] = _NAN
    compiled = tf.function(two_steps, jit_compile=True)
    with pytest.raises(RuntimeError, match="with_xla_checks"):
        compiled(x, x, y)
    weights = [w.numpy() for w in model.weights]

    checked = tf_lossscale.with_xla_checks(compiled, optimizer)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"min_loss_scale=1\.0.*gradients: 1\b"):
        checked(x_nan, x, y)
    for weight, before in zip(model.weights, weights):
        np.testing.assert_array_equal(weight.numpy(), before)
    assert int(optimizer.iterations.numpy()) == 0
    # The record was cleared: training goes on, as without XLA.
    checked(x, x, y)
    assert int(optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize("kwargs", [
    dict(on_min_loss_scale="warn"), dict(on_min_loss_scale="raise"),
    dict(max_consecutive_skips=3)],
                         ids=["warn", "raise", "max_skips"])
def test_unwatched_xla_step_fails_before_it_runs_naming_the_fix(kwargs):
    # XLA drops assertion ops and cannot print: a step whose checks nobody
    # carries out would silently lose them.
    loss_scale = tf_lossscale.DynamicLossScale(**kwargs)

    @tf.function(jit_compile=True)
    def step(g):
        return loss_scale.update([g])[1]

    with pytest.raises(RuntimeError, match="with_xla_checks"):
        step(tf.constant(1.0))
    assert float(loss_scale()) == 2.0**15
    assert bool(tf_lossscale.with_xla_checks(step, loss_scale)(
        tf.constant(1.0)))


@pytest.mark.parametrize("kwargs", [
    dict(on_min_loss_scale="warn", max_consecutive_skips=2),
    dict(on_min_loss_scale="raise", hysteresis=2, max_consecutive_skips=3),
    dict(backoff_factor=0.25, min_loss_scale=2.0, max_loss_scale=2.0**20,
         hysteresis=3, consecutive_hysteresis=True, on_min_loss_scale="warn",
         max_consecutive_skips=5)],
                         ids=["warn_and_limit", "raise_and_limit",
                              "every_argument"])
def test_no_argument_combination_fails_to_compile_under_xla(kwargs):
    loss_scale = tf_lossscale.DynamicLossScale(**kwargs)
    step = tf_lossscale.with_xla_checks(
        tf.function(lambda g: loss_scale.update([g])[1], jit_compile=True),
        loss_scale)
    assert bool(step(tf.constant(1.0)))
    assert not bool(step(tf.constant(_NAN)))

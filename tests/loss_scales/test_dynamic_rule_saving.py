"""The extended dynamic rule's configuration and state survive saving.

Non-default arguments appear in `get_config()` and come back through
`serialize`/`deserialize`, JSON, `LossScaleOptimizer.get_config`/`from_config`
and `.keras` files; default ones stay out, so a default config is still
TensorFlow's. The extra state (hysteresis budget, consecutive skips) travels
in `tf.train.Checkpoint`s and `.keras` files, and a restored object continues
bit for bit where the original would have gone.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
from tests.helpers import dynamic_rule_model as model_lib
from tests.helpers import models
from tests.helpers import reference_oracle as oracle
import tf_lossscale

SEED = 20_240_910

_CONFIGS = {
    "backoff_factor": dict(backoff_factor=0.25),
    "floor_below_one": dict(initial_loss_scale=1.0, min_loss_scale=2.0**-10),
    "ceiling": dict(max_loss_scale=2.0**20),
    "hysteresis": dict(hysteresis=3, consecutive_hysteresis=True),
    "warn": dict(on_min_loss_scale="warn"),
    "everything": dict(initial_loss_scale=512.0, increment_period=3,
                       multiplier=3.0, backoff_factor=0.5,
                       min_loss_scale=0.5, max_loss_scale=1e6, hysteresis=2,
                       consecutive_hysteresis=True, on_min_loss_scale="raise",
                       max_consecutive_skips=50),
}
_FIXED_SKIPPING = {"class_name": "FixedLossScale",
                   "config": {"loss_scale_value": 1.0,
                              "skip_non_finite": True}}


@pytest.mark.parametrize("name", _CONFIGS)
def test_get_config_holds_exactly_the_non_default_arguments(name):
    kwargs = _CONFIGS[name]
    config = tf_lossscale.DynamicLossScale(**kwargs).get_config()
    base = {"initial_loss_scale", "increment_period", "multiplier"}
    assert set(config) == base | set(kwargs)
    for key, value in kwargs.items():
        assert config[key] == value
        assert type(config[key]) is type(value)  # pylint: disable=unidiomatic-typecheck


@pytest.mark.parametrize("name", _CONFIGS)
def test_serialized_config_survives_json_and_deserialize(name):
    original = tf_lossscale.DynamicLossScale(**_CONFIGS[name])
    text = json.dumps(tf_lossscale.serialize(original))
    restored = tf_lossscale.deserialize(json.loads(text))
    assert restored.get_config() == original.get_config()
    assert [v.name for v in restored.variables] == [
        v.name for v in original.variables]
    assert tf_lossscale.serialize(restored) == json.loads(text)


def test_fixed_loss_scale_that_skips_survives_json_and_deserialize():
    restored = tf_lossscale.deserialize(
        json.loads(json.dumps(_FIXED_SKIPPING)))
    assert restored.skip_non_finite is True
    assert tf_lossscale.serialize(restored) == _FIXED_SKIPPING


def test_config_with_whole_float_counts_loads():
    # YAML and some JSON writers turn 2 into 2.0.
    restored = tf_lossscale.deserialize({
        "class_name": "DynamicLossScale",
        "config": {"initial_loss_scale": 8.0, "increment_period": 2.0,
                   "multiplier": 2.0, "hysteresis": 3.0,
                   "max_consecutive_skips": 4.0}})
    config = restored.get_config()
    assert (config["increment_period"], config["hysteresis"],
            config["max_consecutive_skips"]) == (2, 3, 4)
    assert all(type(config[k]) is int for k in (  # pylint: disable=unidiomatic-typecheck
        "increment_period", "hysteresis", "max_consecutive_skips"))


@pytest.mark.parametrize("name", ["everything", "floor_below_one"])
def test_optimizer_config_round_trip_keeps_the_rule(name):
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tf_lossscale.DynamicLossScale(**_CONFIGS[name]))
    config = json.loads(json.dumps(optimizer.get_config()))
    restored = tf_lossscale.LossScaleOptimizer.from_config(config)
    assert restored.loss_scale.get_config() == (
        optimizer.loss_scale.get_config())


def test_optimizer_config_round_trip_keeps_skip_non_finite():
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tf_lossscale.FixedLossScale(1, skip_non_finite=True))
    restored = tf_lossscale.LossScaleOptimizer.from_config(
        json.loads(json.dumps(optimizer.get_config())))
    assert restored.loss_scale.get_config() == {
        "loss_scale_value": 1.0, "skip_non_finite": True}


# ---------------------------------------------------------------------------
# Checkpoints.

_CHECKPOINT_RULE = dict(initial_loss_scale=64.0, increment_period=4,
                        multiplier=2.0, backoff_factor=0.5,
                        min_loss_scale=0.125, hysteresis=3,
                        on_min_loss_scale="warn")


def _run(loss_scale, pattern):
    states = []
    for finite in pattern:
        loss_scale.update([tf.constant(1.0 if finite else np.nan)])
        states.append([v.numpy() for v in loss_scale.variables])
    return states


def test_checkpoint_holds_every_state_variable_under_its_name(tmp_path):
    loss_scale = tf_lossscale.DynamicLossScale(**_CHECKPOINT_RULE)
    path = tf.train.Checkpoint(loss_scale=loss_scale).write(
        os.path.join(tmp_path, "ckpt"))
    names = {name for name, _ in tf.train.list_variables(path)}
    for variable in ("current_loss_scale", "good_steps",
                     "hysteresis_remaining", "consecutive_skips"):
        assert f"loss_scale/{variable}/.ATTRIBUTES/VARIABLE_VALUE" in names


def test_restore_mid_sequence_continues_bit_for_bit(tmp_path):
    rng = oracle.keyed_rng(SEED, 0)
    original = tf_lossscale.DynamicLossScale(**_CHECKPOINT_RULE)
    warm_up = [True, False, False, True, False, True, True, False]
    _run(original, warm_up)
    scale, good_steps, budget, skips = [v.numpy() for v in original.variables]
    # A state a fresh object does not have, so the restore is visible.
    assert (scale, budget, skips) != (64.0, 3, 0) and good_steps == 0
    path = tf.train.Checkpoint(loss_scale=original).write(
        os.path.join(tmp_path, "ckpt"))

    continuation = model_lib.random_pattern(rng, 60)
    expected = _run(original, continuation)
    restored = tf_lossscale.DynamicLossScale(**_CHECKPOINT_RULE)
    tf.train.Checkpoint(loss_scale=restored).read(path).assert_consumed()
    actual = _run(restored, continuation)

    model = model_lib.RuleModel(**_CHECKPOINT_RULE)
    for finite in warm_up:
        model.step(finite)
    for step, (got, want, finite) in enumerate(
            zip(actual, expected, continuation)):
        model.step(finite)
        oracle.assert_same_float32_bits(got[0], want[0], f"step {step}")
        oracle.assert_same_float32_bits(got[0], model.scale, f"step {step}")
        assert got[1:] == want[1:] == [model.good_steps,
                                       model.hysteresis_left,
                                       model.skips_in_a_row], step


def test_tf_reference_checkpoint_restores_into_a_rule_with_more_state(
        tmp_path):
    """Turning hysteresis on when resuming a run saved with TF's rule."""
    reference = oracle.reference_dynamic(initial_loss_scale=64,
                                         increment_period=4)
    for finite in (True, False, True):
        reference.update([tf.constant(1.0 if finite else np.nan)])
    path = tf.train.Checkpoint(loss_scale=reference).write(
        os.path.join(tmp_path, "reference"))
    ours = tf_lossscale.DynamicLossScale(initial_loss_scale=64,
                                         increment_period=4, hysteresis=2)
    tf.train.Checkpoint(loss_scale=ours).read(path)
    # The saved state, plus a full budget for the new feature.
    assert [v.numpy() for v in ours.variables] == [32.0, 1, 2]


# ---------------------------------------------------------------------------
# .keras files.


def _fit(model, seed, nan=False):
    model.fit(*training.normal_data(8, seed=seed, nan_batches=[0] if nan else []),
              batch_size=8, epochs=1, shuffle=False, verbose=0)


@pytest.mark.usefixtures("keras_isolation")
def test_keras_file_keeps_rule_and_state_and_training_continues_identically(
        tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    rule = dict(_CONFIGS["everything"], increment_period=2)
    model = models.tiny_model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9),
        loss_scale=tf_lossscale.DynamicLossScale(**rule))
    model.compile(optimizer, "mse")
    for seed, nan in enumerate([False, True, False, True]):
        _fit(model, seed, nan)
    state = [v.numpy() for v in optimizer.loss_scale.variables]
    assert len(state) == 4 and state[2] != rule["hysteresis"]
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)

    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, tf_lossscale.LossScaleOptimizer)
    assert loaded.optimizer.loss_scale.get_config() == (
        optimizer.loss_scale.get_config())
    for got, want in zip(loaded.optimizer.loss_scale.variables, state):
        np.testing.assert_array_equal(got.numpy(), want)

    for seed, nan in [(10, True), (11, False), (12, False), (13, True)]:
        _fit(model, seed, nan)
        _fit(loaded, seed, nan)
    for got, want in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    for got, want in zip(loaded.optimizer.loss_scale.variables,
                         optimizer.loss_scale.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())

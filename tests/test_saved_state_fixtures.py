"""Saved state is a promise: files written by earlier versions still load.

`tests/fixtures/` holds, per released state layout, a `.keras` file, a
`tf.train.Checkpoint` and serialized configs, written by
`tests/fixtures/make_fixtures.py` with that version's code, and the values it
recorded. Each test loads one of them with the current code and checks every
value, then (for the model) takes one more step and checks that training
continues exactly as it would have.
"""

import json
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from fixtures import make_fixtures

pytestmark = pytest.mark.usefixtures("keras_isolation")

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
# v0_1: written by the 0.1.0 release. main_2f3d353: written by main at
# commit 2f3d353, whose checkpoints hold the inner optimizer's state under the
# plain names too, before the wrapper's `_variables` was added to them.
VERSIONS = ("v0_1", "main_2f3d353")


def _expected(version):
    with np.load(FIXTURES / f"expected_{version}.npz") as data:
        return dict(data)


def _assert_equal(actual, expected, what):
    np.testing.assert_array_equal(np.asarray(actual), expected, err_msg=what)


def _assert_state_as_recorded(model, optimizer, expected):
    for key, value in make_fixtures.optimizer_state(optimizer).items():
        _assert_equal(value, expected[f"optimizer_{key}"], key)
    for index, weight in enumerate(model.weights):
        _assert_equal(weight, expected[f"weight_{index}"], f"weight {index}")
    for index, slot in enumerate(make_fixtures.inner_slots(optimizer)):
        _assert_equal(slot, expected[f"slot_{index}"], f"inner variable {index}")


def _assert_next_step_as_recorded(model, expected):
    model.train_on_batch(*make_fixtures.batch(
        len(make_fixtures.FINITE_SCHEDULE)))
    for index, weight in enumerate(model.weights):
        _assert_equal(weight, expected[f"weight_after_step_{index}"],
                      f"weight {index} after one more step")


@pytest.mark.parametrize("version", VERSIONS)
def test_keras_file_loads_with_recorded_state_and_trains_on(version):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.models.load_model(FIXTURES / f"model_{version}.keras")
    assert isinstance(model.optimizer, tf_lossscale.LossScaleOptimizer)
    expected = _expected(version)
    _assert_state_as_recorded(model, model.optimizer, expected)
    _assert_next_step_as_recorded(model, expected)


@pytest.mark.parametrize("version", VERSIONS)
def test_checkpoint_restores_recorded_state_and_trains_on(version):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = make_fixtures.model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.Adam(0.01), loss_scale=make_fixtures.loss_scale())
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        str(FIXTURES / f"checkpoint_{version}" / "model")).assert_consumed()
    expected = _expected(version)
    _assert_state_as_recorded(model, optimizer, expected)
    _assert_next_step_as_recorded(model, expected)


@pytest.mark.parametrize("version", VERSIONS)
def test_loss_scale_checkpoint_restores_recorded_state(version):
    loss_scale = make_fixtures.loss_scale()
    tf.train.Checkpoint(loss_scale=loss_scale).read(
        str(FIXTURES / f"checkpoint_{version}" / "loss_scale")
    ).assert_consumed()
    expected = _expected(version)
    _assert_equal(loss_scale(), expected["bare_loss_scale"], "loss scale")
    _assert_equal(loss_scale.good_steps, expected["bare_good_steps"],
                  "good steps")


@pytest.mark.parametrize("version", VERSIONS)
def test_configs_load_as_the_same_objects(version):
    configs = json.loads((FIXTURES / f"configs_{version}.json").read_text())
    optimizer = keras.optimizers.deserialize(configs["optimizer"])
    assert isinstance(optimizer, tf_lossscale.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    assert tf_lossscale.serialize(optimizer.loss_scale) == (
        configs["optimizer"]["config"]["loss_scale"])
    for key in ("dynamic_loss_scale", "fixed_loss_scale"):
        assert tf_lossscale.serialize(
            tf_lossscale.deserialize(configs[key])) == configs[key]

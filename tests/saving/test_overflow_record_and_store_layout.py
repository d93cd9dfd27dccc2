"""What `.keras` files and `tf.train.Checkpoint`s hold of the Keras 3
wrapper: the overflow record (`last_nonfinite_variables()`) and the store's
keys (docs/guides/saving.md, "What the files hold"; monitoring.md)."""

import os
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale

from tests.helpers import models  # pylint: disable=g-bad-import-order

pytestmark = pytest.mark.usefixtures("keras_isolation")

_BAD = {1: float("nan"), 2: -float("inf")}  # variable index -> gradient value


def _skipped_once(optimizer_class=keras.optimizers.Adam):
    """A compiled model whose optimizer applied one step, then skipped one
    whose gradients were bad for the variables of `_BAD` only."""
    model = models.tiny_model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        optimizer_class(0.01),
        tf_lossscale.DynamicLossScale(8.0, increment_period=100, hysteresis=2))
    model.compile(optimizer, "mse")
    variables = model.trainable_variables
    optimizer.build(variables)
    for bad in ({}, _BAD):
        grads = [tf.ones_like(v) for v in variables]
        for index, value in bad.items():
            grads[index] = tf.fill(variables[index].shape, value)
        optimizer.scale_loss(tf.constant(1.0))
        optimizer.apply(grads, variables)
    assert int(optimizer.skipped_steps) == 1
    assert optimizer.last_nonfinite_variables() == [
        variables[i].path for i in sorted(_BAD)]
    return model, optimizer


def test_keras_file_keeps_the_overflow_record(tmp_path):
    model, _ = _skipped_once()
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = keras.models.load_model(path)

    variables = loaded.trainable_variables
    assert loaded.optimizer.last_nonfinite_variables() == [
        variables[i].path for i in sorted(_BAD)]
    assert int(loaded.optimizer.skipped_steps) == 1


def test_checkpoint_leaves_the_overflow_record_out(tmp_path):
    model, optimizer = _skipped_once()
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(
        str(tmp_path / "ckpt"))

    assert not [name for name, _ in tf.train.list_variables(path)
                if "nonfinite" in name]
    fresh = models.tiny_model(seed=1)
    fresh_optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        tf_lossscale.DynamicLossScale(8.0, increment_period=100, hysteresis=2))
    fresh.compile(fresh_optimizer, "mse")
    fresh_optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).read(
        path).assert_consumed()
    # The count comes back; the record is left at its initial value.
    assert int(fresh_optimizer.skipped_steps) == 1
    assert fresh_optimizer.last_nonfinite_variables() == []


def _optimizer_store(keras_file, tmp_path):
    with zipfile.ZipFile(keras_file) as archive:
        archive.extract("model.weights.h5", tmp_path)
    with h5py.File(os.path.join(tmp_path, "model.weights.h5")) as store:
        return {key: np.array(value) for key, value
                in store["optimizer/vars"].items()}


def test_keras_file_store_keys_wrapper_then_inner_then_named_state(tmp_path):
    model, optimizer = _skipped_once()
    path = str(tmp_path / "model.keras")
    model.save(path)

    store = _optimizer_store(path, tmp_path)

    inner = optimizer.inner_optimizer.variables
    scale = optimizer.loss_scale.variables
    assert set(store) == (
        {str(i) for i in range(3 + len(inner))}
        | {f"loss_scale.{i}" for i in range(len(scale))}
        | {"last_nonfinite"})
    # "0", "1": the base class's unused iteration and learning rate.
    assert store["0"].shape == store["1"].shape == ()
    assert store["2"] == int(optimizer.skipped_steps)
    for index, variable in enumerate(inner):
        np.testing.assert_array_equal(store[str(3 + index)], variable.numpy())
    for index, variable in enumerate(scale):
        np.testing.assert_array_equal(store[f"loss_scale.{index}"],
                                      variable.numpy())
    flags = store["last_nonfinite"]
    assert [model.trainable_variables[i].path
            for i in np.flatnonzero(flags)] == (
                optimizer.last_nonfinite_variables())

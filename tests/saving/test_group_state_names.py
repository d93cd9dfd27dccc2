"""Where a `LossScaleGroup`'s state is saved (docs/guides/
several-optimizers.md, "Saving"): after the scale's own variables, as
`loss_scale.2` and `.3` of the optimizer in `.keras` files; a checkpoint of
an optimizer without a group restores into one given a group, the scale
coming back and the iteration starting afresh, so that `assert_consumed()`
names the group's two variables. And `optimizer.loss_scale` is the
optimizer's `GroupMember`, `optimizer.loss_scale_group` the group."""

import io
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale.groups import iteration
from tf_lossscale.groups import member

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _grouped_model():
    group = tf_lossscale.LossScaleGroup(
        tf_lossscale.DynamicLossScale(2.0**10, increment_period=2))
    d, g = [tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                            loss_scale=group)
            for _ in range(2)]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=d, loss="mse")
    return model, group, d, g


def test_a_grouped_optimizers_loss_scale_is_its_member_of_the_group():
    _, group, d, g = _grouped_model()
    for optimizer in (d, g):
        assert isinstance(optimizer.loss_scale, member.GroupMember)
        assert optimizer.loss_scale.group is group
        assert optimizer.loss_scale_group is group
    assert d.loss_scale is not g.loss_scale
    assert float(d.loss_scale()) == float(g.loss_scale()) == float(group())


def test_a_keras_file_stores_the_groups_iteration_after_the_scale(tmp_path):
    model, group, d, _ = _grouped_model()
    variables = model.trainable_variables
    # Two iterations of d alone would be refused: one step leaves the
    # iteration open (d stepped, g not), the group's state not zero.
    d.apply([tf.fill(v.shape, float("nan")) for v in variables], variables)
    stepped, overflowed = [int(v) for v in group.variables]
    assert (stepped, overflowed) != (0, 0)
    path = tmp_path / "grouped.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        weights = h5py.File(io.BytesIO(archive.read("model.weights.h5")),
                            "r")
        stored = {name: np.asarray(weights[f"optimizer/vars/{name}"])
                  for name in weights["optimizer/vars"]}
    scale = [v.numpy() for v in group.loss_scale.variables]
    assert len(scale) == 2
    np.testing.assert_array_equal(stored["loss_scale.0"], scale[0])
    np.testing.assert_array_equal(stored["loss_scale.1"], scale[1])
    assert int(stored["loss_scale.2"]) == stepped
    assert int(stored["loss_scale.3"]) == overflowed


def test_a_checkpoint_without_a_group_restores_into_one_naming_its_two(
        tmp_path):
    plain = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), tf_lossscale.DynamicLossScale(
            2.0**10, increment_period=2))
    variable = keras.Variable(np.ones(2, np.float32))
    plain.build([variable])
    plain.apply([tf.fill([2], float("nan"))], [variable])  # Backs off.
    path = tf.train.Checkpoint(optimizer=plain).write(str(tmp_path / "ck"))
    group = tf_lossscale.LossScaleGroup(tf_lossscale.DynamicLossScale(
        2.0**10, increment_period=2))
    grouped = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                              loss_scale=group)
    grouped.build([keras.Variable(np.ones(2, np.float32))])

    status = tf.train.Checkpoint(optimizer=grouped).read(path)

    with pytest.raises(AssertionError) as raised:
        status.assert_consumed()
    message = str(raised.value)
    assert f"'{iteration.STEPPED}:0'" in message, message
    assert f"'{iteration.OVERFLOWED}:0'" in message, message
    assert "Found 2 Python objects" in message, message
    status.expect_partial()
    assert float(group()) == float(plain.loss_scale()) == 2.0**9
    assert int(grouped.skipped_steps) == int(plain.skipped_steps) == 1
    assert [int(v) for v in group.variables] == [0, 0]

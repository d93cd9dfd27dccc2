"""`LossScaleOptimizer.last_nonfinite_variables()`: which gradients overflowed.

It names, by `variable.path`, exactly the variables whose gradients held NaN
or +-Inf on the most recent skipped step, on any replica; `[]` before any
skip; applied steps leave it alone.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import models
from tests.helpers import training
import tf_lossscale

pytestmark = pytest.mark.usefixtures("keras_isolation")

_NAN = float("nan")
_INF = float("inf")


def _optimizer():
    return tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tf_lossscale.DynamicLossScale(8.0, increment_period=100))


def _gradients(variables, bad=None):
    """Ones for every variable; `bad` maps variable index -> a bad value."""
    grads = [tf.ones_like(v) for v in variables]
    for index, value in (bad or {}).items():
        flat = tf.reshape(grads[index], [-1])
        flat = tf.tensor_scatter_nd_update(flat, [[0]], [value])
        grads[index] = tf.reshape(flat, grads[index].shape)
    return grads


@pytest.mark.parametrize("in_function", [False, True],
                         ids=["eager", "function"])
def test_names_exactly_the_overflowing_variables_of_the_last_skip(
        in_function):
    variables = models.tiny_model().trainable_variables
    optimizer = _optimizer()
    optimizer.build(variables)

    def step(grads):
        optimizer.scale_loss(tf.constant(1.0))
        optimizer.apply(grads, variables)

    step = tf.function(step) if in_function else step
    assert optimizer.last_nonfinite_variables() == []
    step(_gradients(variables))
    assert optimizer.last_nonfinite_variables() == []

    step(_gradients(variables, {0: _NAN, 3: -_INF}))
    assert optimizer.last_nonfinite_variables() == [
        variables[0].path, variables[3].path]
    before = [v.numpy() for v in variables]
    step(_gradients(variables))  # Applied: the record stays.
    assert optimizer.last_nonfinite_variables() == [
        variables[0].path, variables[3].path]
    assert not np.array_equal(variables[0].numpy(), before[0])

    step(_gradients(variables, {1: _INF}))
    assert optimizer.last_nonfinite_variables() == [variables[1].path]
    assert int(optimizer.skipped_steps) == 2


def test_tf2_protocol_reports_the_same_way():
    variables = models.tiny_model().trainable_variables
    optimizer = _optimizer()
    optimizer.get_scaled_loss(tf.constant(1.0))
    scaled = _gradients(variables, {2: _NAN})
    optimizer.apply_gradients(zip(optimizer.get_unscaled_gradients(scaled),
                                  variables))
    assert optimizer.last_nonfinite_variables() == [variables[2].path]


def test_indexed_slices_gradients_are_named():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,), dtype="int32"),
                              keras.layers.Embedding(10, 3),
                              keras.layers.Dense(1)])
    variables = model.trainable_variables
    optimizer = _optimizer()

    @tf.function
    def step(bad):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.constant([[1, 4]]))) * bad
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        # Only the embedding's rows overflow.
        grads[0] = tf.IndexedSlices(grads[0].values * _INF, grads[0].indices,
                                    grads[0].dense_shape)
        optimizer.apply_gradients(zip(grads, variables))

    step(tf.constant(1.0))
    assert optimizer.last_nonfinite_variables() == [variables[0].path]


@pytest.mark.parametrize("compile_args", [
    {}, {"jit_compile": True}, {"jit_compile": True,
                                "steps_per_execution": 2}],
                         ids=["tf_function", "xla", "xla_2_steps_per_call"])
def test_fit_records_the_variables_of_a_skipped_batch(compile_args):
    model = models.tiny_model()
    optimizer = _optimizer()
    model.compile(optimizer=optimizer, loss="mse", **compile_args)
    x = np.ones((8, 3), np.float32)
    y = np.ones((8, 1), np.float32)
    callbacks = [tf_lossscale.XlaChecks()]
    model.fit(x, y, batch_size=4, verbose=0, callbacks=callbacks)
    assert optimizer.last_nonfinite_variables() == []
    x[5, 0] = _NAN  # Second batch: every gradient becomes NaN.
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False,
              callbacks=callbacks)
    assert int(optimizer.skipped_steps) == 1
    assert optimizer.last_nonfinite_variables() == [
        v.path for v in model.trainable_variables]


@pytest.mark.parametrize("bad_by_replica", [
    {1: {2: _NAN}},
    {0: {0: _INF}, 1: {3: _NAN}},
], ids=["replica_1_only", "different_variables_per_replica"])
def test_mirrored_combines_every_replica(bad_by_replica):
    strategy = training.mirrored(2)
    with strategy.scope():
        variables = models.tiny_model().trainable_variables
        optimizer = _optimizer()
        optimizer.build(variables)

    def replica_step(poison):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        grads = [tf.ones_like(v) + poison[replica, index]
                 for index, v in enumerate(variables)]
        optimizer.scale_loss(tf.constant(1.0))
        optimizer.apply(grads, variables)

    poison = np.zeros((2, len(variables)), np.float32)
    for replica, bad in bad_by_replica.items():
        for index, value in bad.items():
            poison[replica, index] = value

    @tf.function
    def step(poison):
        strategy.run(replica_step, args=(poison,))

    with strategy.scope():
        step(tf.zeros_like(tf.constant(poison)))
        assert optimizer.last_nonfinite_variables() == []
        step(tf.constant(poison))
    expected = sorted({i for bad in bad_by_replica.values() for i in bad})
    assert optimizer.last_nonfinite_variables() == [
        variables[i].path for i in expected]
    assert int(optimizer.skipped_steps) == 1


@pytest.mark.parametrize("built_by", ["build", "first_apply"])
def test_overflow_record_lives_in_the_optimizers_own_name_scope(built_by):
    # The record's path is the same whichever call builds the optimizer; the
    # first apply used to open the optimizer's scope twice.
    optimizer = _optimizer()
    variables = [tf.Variable(tf.ones([2]), name="w")]
    if built_by == "build":
        optimizer.build(variables)
    else:
        optimizer.apply(_gradients(variables), variables)
    record = optimizer._last_nonfinite  # pylint: disable=protected-access
    assert record.path == f"{optimizer.name}/last_nonfinite"

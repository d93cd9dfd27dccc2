"""`FailureWatch` over a custom loop with two optimizers in one
`tf_lossscale.LossScaleGroup` (a two-part model: one optimizer per layer;
on one device and under MirroredStrategy):
the watch reads the group's shared scale, and `report.fix(model,
optimizers=...)` carries every optimizer of the group on, each with its own
slots and skipped steps, in a new group with the old one's state."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests.helpers import late_failures as late
from tests.helpers import training

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_group")]

GROWTH = 4.0  # The logits' bias, times this after each step.


def _model():
    model = late.two_layer_classifier(keras)
    group = tf_lossscale.LossScaleGroup(
        tf_lossscale.DynamicLossScale(1024.0, 1000))
    optimizers = [tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9), loss_scale=group)
                  for _ in range(2)]
    # The diagnosis' loss; the loop computes its own.
    model.compile(optimizer=optimizers[0],
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    for optimizer, name in zip(optimizers, ("hidden", "logits")):
        optimizer.build(model.get_layer(name).trainable_variables)
    model.get_layer("logits").bias.assign([1.0, -1.0])
    return model, optimizers


def _step_function(model, optimizers, strategy=None):
    parts = [model.get_layer(name).trainable_variables
             for name in ("hidden", "logits")]

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True),
                global_batch_size=tf.shape(y)[0] * (
                    strategy.num_replicas_in_sync if strategy else 1))
            scaled = optimizers[0].scale_loss(loss)
        grads = tape.gradient(scaled, parts)
        for optimizer, g, v in zip(optimizers, grads, parts):
            optimizer.apply_gradients(zip(g, v))
        return loss

    @tf.function
    def step(x, y):
        if strategy is None:
            return replica_step(x, y)
        return strategy.reduce("SUM", strategy.run(replica_step, args=(
            x, y)), axis=None)

    return step


def _batch():
    return late.two_layer_data(8)


@pytest.fixture(scope="module")
def failed():
    model, optimizers = _model()
    x, y = _batch()
    watch = tf_lossscale.FailureWatch([(x, y)], steps=1, settle_steps=3,
                                      max_consecutive_skips=3)
    step = _step_function(model, optimizers)
    bias = model.get_layer("logits").bias
    with pytest.raises(tf_lossscale.Float16FailureError) as raised:
        for _ in range(40):
            loss = step(x, y)
            bias.assign(bias * GROWTH)
            watch.after_step(model, loss)
    return model, optimizers, raised.value.report


def test_the_watch_names_the_layer_from_the_groups_scale(failed):
    model, optimizers, report = failed
    assert report.diagnosis.first_nonfinite_layer == "logits"
    # Both optimizers skipped the failing steps: the shared scale backed off.
    assert [int(o.skipped_steps) for o in optimizers] == [
        report.skipped_steps] * 2
    assert report.scale == float(optimizers[1].loss_scale())
    assert report.settled_scale == 1024.0


def test_fix_without_the_groups_optimizers_says_to_pass_them(failed):
    model, optimizers, report = failed
    with pytest.raises(ValueError, match=r"LossScaleGroup.*optimizers="):
        report.fix(model)
    with pytest.raises(ValueError, match="every optimizer of"):
        report.fix(model, optimizers=optimizers[:1])


def test_fix_refuses_a_group_optimizer_of_another_models_variables(failed):
    _, _, report = failed
    model, _ = _model()
    group = tf_lossscale.LossScaleGroup()
    ours, theirs = [tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), loss_scale=group) for _ in range(2)]
    model.compile(optimizer=ours, loss="sparse_categorical_crossentropy")
    ours.build(model.trainable_variables)
    theirs.build([keras.Variable(np.zeros(3, np.float32), name="elsewhere")])
    with pytest.raises(ValueError, match=r"'elsewhere'.*not trainable"):
        report.fix(model, optimizers=[ours, theirs])


def test_fix_carries_every_optimizer_of_the_group_on(failed):
    model, optimizers, report = failed
    fixed, carried = report.fix(model, optimizers=optimizers)
    assert fixed.get_layer("logits").compute_dtype == "float32"
    assert fixed.optimizer is carried[0]
    new_group = carried[0].loss_scale.group
    assert carried[1].loss_scale.group is new_group
    assert new_group is not optimizers[0].loss_scale.group
    assert new_group.skip == optimizers[0].loss_scale.group.skip
    assert float(new_group()) == report.settled_scale
    for old, new, name in zip(optimizers, carried, ("hidden", "logits")):
        assert int(new.iterations) == int(old.iterations) > 0
        assert int(new.skipped_steps) == int(old.skipped_steps)
        for source, target in zip(old.inner_optimizer.variables,
                                  new.inner_optimizer.variables):
            np.testing.assert_array_equal(target.numpy(), source.numpy())
        # Built for the fixed model's variables of the same layer.
        assert [id(v) for v in new.inner_optimizer._trainable_variables] == [
            id(v) for v in fixed.get_layer(name).trainable_variables]
    for source, target in zip(model.weights, fixed.weights):
        np.testing.assert_array_equal(target.numpy(), source.numpy())


def test_the_loop_goes_on_with_the_carried_group(failed):
    model, optimizers, report = failed
    fixed, carried = report.fix(model, optimizers=optimizers)
    step = _step_function(fixed, carried)
    x, y = _batch()
    skipped = [int(o.skipped_steps) for o in carried]
    iterations = [int(o.iterations) for o in carried]
    good = int(carried[0].loss_scale.group.loss_scale.good_steps)
    losses = [float(step(x, y)) for _ in range(4)]
    assert np.all(np.isfinite(losses))
    assert [int(o.skipped_steps) for o in carried] == skipped
    assert [int(o.iterations) for o in carried] == [i + 4 for i in iterations]
    # One good step of the shared scale per iteration of both optimizers.
    assert int(carried[0].loss_scale.group.loss_scale.good_steps) == good + 4


def test_a_group_under_mirrored_strategy_is_watched_and_carried_on():
    strategy = training.mirrored(2)
    with strategy.scope():
        model, optimizers = _model()
    x, y = _batch()
    ((x_parts, y_parts),) = list(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((x, y)).unbatch().batch(len(x))))
    watch = tf_lossscale.FailureWatch([(x, y)], steps=1, settle_steps=3,
                                      max_consecutive_skips=3,
                                      on_failure="stop", verbose=False)
    step = _step_function(model, optimizers, strategy)
    bias = model.get_layer("logits").bias
    report = None
    for _ in range(40):
        loss = step(x_parts, y_parts)
        bias.assign(bias * GROWTH)
        report = watch.after_step(model, loss)
        if report is not None:
            break
    assert report is not None, "no failure in 40 steps"
    assert report.diagnosis.first_nonfinite_layer == "logits"
    fixed, carried = report.fix(model, optimizers=optimizers)
    assert fixed.distribute_strategy is strategy
    applied = [int(np.asarray(o.iterations)) for o in optimizers]
    step = _step_function(fixed, carried, strategy)
    losses = [float(step(x_parts, y_parts)) for _ in range(4)]
    assert np.all(np.isfinite(losses))
    assert [int(np.asarray(o.skipped_steps)) for o in carried] == [
        report.skipped_steps] * 2
    assert [int(np.asarray(o.iterations)) for o in carried] == [
        count + 4 for count in applied]

"""Journey: a GAN's two optimizers on one loss scale, in mixed_float16.

A DCGAN-style model (`tests/helpers/gan.py`: Keras 3's example's
`train_step`, two optimizers, two tapes) on 8x8 synthetic images, under the
global `mixed_float16` policy, its optimizers in one `LossScaleGroup`, trains
for 16 steps with `fit`, watched by `LossScaleMonitor(optimizers=...)`; at
step 9 a NaN is planted in the generator's gradients (on the last replica
under MirroredStrategy). Its losses track a float32 run from the same weights
on the same data (whose group of a fixed scale of 1 skips the same step); the
planted NaN skips the generator's step only, leaving its weights and slots
bit-identical, and backs the scale off once; the scale takes one step per
iteration, as TensorFlow's reference does fed one step per iteration. In a
`tf.function`, under XLA (`jit_compile=True`) and under MirroredStrategy
with 2 replicas. The same journey with tf-keras runs in the session's
tf-keras process (`tests/tf_keras/test_tf_keras_journeys.py`).
"""

import contextlib
import functools
import warnings

import keras
import numpy as np
import pytest

import tf_lossscale
from tests.helpers import gan
from tests.helpers import reference_oracle
from tests.helpers import training

# The runs are made once per module and shared by the tests.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("several_optimizers")]

STEPS, BATCH, POISONED = 16, 8, 9
INITIAL, PERIOD = 2.0**12, 4
MODES = ("tf.function", "xla", "mirrored")


@functools.cache
def _arrays():
    return gan.data(STEPS, BATCH, poison_batches=[POISONED])


@functools.cache
def _weights():
    return gan.initial_weights(keras)


def _optimizers(loss_scale):
    return [tf_lossscale.LossScaleOptimizer(gan.inner_optimizer(keras),
                                            loss_scale=loss_scale)
            for _ in range(2)]


@functools.cache
def _float32_run():
    """The float32 reference: no scaling, the poisoned step skipped."""
    keras.mixed_precision.set_global_policy("float32")
    group = tf_lossscale.LossScaleGroup(
        tf_lossscale.FixedLossScale(1, skip_non_finite=True))
    return gan.fit(keras, gan.build(keras, _weights()), _optimizers(group),
                   _arrays(), BATCH)


@functools.cache
def _mixed_run(mode):
    strategy = training.mirrored(2) if mode == "mirrored" else None
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope() if strategy else contextlib.nullcontext():
            group = tf_lossscale.LossScaleGroup(
                tf_lossscale.DynamicLossScale(INITIAL, PERIOD))
            d_optimizer, g_optimizer = _optimizers(group)
            monitor = tf_lossscale.LossScaleMonitor(
                optimizers={"d": d_optimizer, "g": g_optimizer})
            return gan.fit(keras, gan.build(keras, _weights()),
                           [d_optimizer, g_optimizer], _arrays(), BATCH,
                           jit_compile=mode == "xla", callbacks=[monitor],
                           snapshots=(POISONED - 1, POISONED))
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("mode", MODES)
def test_mixed_float16_losses_track_the_float32_run(mode):
    mixed, reference = _mixed_run(mode), _float32_run()
    assert len(mixed) == len(reference) == STEPS
    for step, (ours, theirs) in enumerate(zip(mixed, reference)):
        for key in ("d_loss", "g_loss"):
            # float16 rounding: measured here ~1e-3 on losses near 0.7.
            assert abs(ours[key] - theirs[key]) < 0.01, (mode, step, key)


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_in_one_optimizers_gradients_skips_its_step_only(mode):
    mixed = _mixed_run(mode)
    before, after = (mixed[POISONED - 1]["values"],
                     mixed[POISONED]["values"])
    for key in ("g", "g_inner"):  # Weights, slots and step count.
        for now, was in zip(after[key], before[key]):
            np.testing.assert_array_equal(now, was, err_msg=key)
    # The discriminator's step of that iteration was applied.
    assert not np.array_equal(after["d"][0], before["d"][0])
    assert int(after["d_inner"][0]) == int(before["d_inner"][0]) + 1
    assert [step["skipped"] for step in mixed] == (
        [[0, 0]] * POISONED + [[0, 1]] * (STEPS - POISONED))


@pytest.mark.parametrize("mode", MODES)
def test_the_scale_takes_one_step_per_iteration(mode):
    scales = [step["scale"] for step in _mixed_run(mode)]
    reference_oracle.assert_same_float32_bits(
        scales, reference_oracle.reference_scales(
            [step != POISONED for step in range(STEPS)], INITIAL, PERIOD,
            2.0), mode)
    # The planted NaN backed the scale off once.
    assert scales[POISONED] == scales[POISONED - 1] / 2


def test_the_monitor_logs_the_shared_scale_once_and_each_optimizers_skips():
    for step in _mixed_run("tf.function"):
        logs = step["logs"]
        assert sorted(logs) == ["d_skipped_steps", "g_skipped_steps",
                                "loss_scale"], sorted(logs)
        assert logs["loss_scale"] == step["scale"]
        assert [logs["d_skipped_steps"], logs["g_skipped_steps"]] == (
            step["skipped"])


def test_two_wrappers_on_one_scale_without_a_group_warn_and_step_it_twice():
    # What 0.5.0 did silently: each optimizer's step is a step of the scale.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        loss_scale = tf_lossscale.DynamicLossScale(INITIAL, PERIOD)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizers = _optimizers(loss_scale)
        assert [w.category for w in caught] == [
            tf_lossscale.SharedLossScaleWarning], caught
        assert caught[0].filename == __file__
        assert "LossScaleGroup" in str(caught[0].message)
        steps = gan.fit(keras, gan.build(keras, _weights()), optimizers,
                        _arrays(), BATCH)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Two steps of the scale per iteration: d's, then g's.
    per_optimizer_step = reference_oracle.reference_scales(
        [not (step == POISONED and optimizer == 1)
         for step in range(STEPS) for optimizer in (0, 1)],
        INITIAL, PERIOD, 2.0)
    reference_oracle.assert_same_float32_bits(
        [step["scale"] for step in steps], per_optimizer_step[1::2])


def test_a_group_gives_no_warning_and_refuses_its_bare_loss_scale():
    group = tf_lossscale.LossScaleGroup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d_optimizer, g_optimizer = _optimizers(group)
    assert d_optimizer.loss_scale_group is g_optimizer.loss_scale_group is (
        group)
    assert d_optimizer.loss_scale is not g_optimizer.loss_scale
    assert d_optimizer.dynamic and d_optimizer.initial_scale == 2.0**15
    inner = keras.optimizers.SGD()
    with pytest.raises(ValueError, match="give the optimizer the group"):
        tf_lossscale.LossScaleOptimizer(inner, loss_scale=group.loss_scale)
    with pytest.raises(ValueError, match="is the group member of"):
        tf_lossscale.LossScaleOptimizer(
            inner, loss_scale=d_optimizer.loss_scale)
    # The refusals left the inner optimizer free to be wrapped.
    tf_lossscale.LossScaleOptimizer(inner, loss_scale=group)


def test_a_groups_optimizers_live_under_one_strategy():
    group = tf_lossscale.LossScaleGroup()
    d_optimizer = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(),
                                                  loss_scale=group)
    with training.mirrored(2).scope():
        with pytest.raises(ValueError, match="live under one strategy"):
            tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(),
                                            loss_scale=group)
    assert group.members == [d_optimizer.loss_scale]


def test_a_loss_scale_an_optimizer_holds_cannot_join_a_group():
    loss_scale = tf_lossscale.DynamicLossScale()
    optimizer = tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD(),
                                                loss_scale=loss_scale)
    with pytest.raises(ValueError, match=f"held by the optimizer.*"
                       f"'{optimizer.name}'"):
        tf_lossscale.LossScaleGroup(loss_scale)


def test_an_optimizer_made_from_a_grouped_ones_config_gets_a_group_of_its_own():
    group = tf_lossscale.LossScaleGroup(
        tf_lossscale.DynamicLossScale(2.0**10, 7), skip="together")
    d_optimizer, _ = _optimizers(group)
    config = keras.optimizers.serialize(d_optimizer)
    assert config["config"]["loss_scale"] == tf_lossscale.serialize(group)
    again = keras.optimizers.deserialize(config)
    assert again.loss_scale_group is not group
    assert again.loss_scale_group.get_config() == group.get_config()
    assert again.loss_scale_group.members == [again.loss_scale]

"""Checkpoints and SavedModels carry the dynamic loss scale's state.

Training that resumes must resume the loss scale too: the scale and the count
of good steps towards the next growth. tf_lossscale stores both under the same
names as TensorFlow's reference `tf.compat.v1.mixed_precision.DynamicLossScale`,
so a checkpoint moves between the two in either direction, and a restored
object continues bit for bit where the saved one would have gone.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import reference_oracle as oracle
import tf_lossscale

SEED = 20_200_915

SCALE_KEY = "loss_scale/current_loss_scale/.ATTRIBUTES/VARIABLE_VALUE"
GOOD_STEPS_KEY = "loss_scale/good_steps/.ATTRIBUTES/VARIABLE_VALUE"

# Periods above 1 so that a saved, unfinished count of good steps decides
# when the restored object grows next.
PARAMS = {
    "small_multiplier_three": {"initial_loss_scale": 4.0,
                               "increment_period": 5, "multiplier": 3.0},
    "defaults_short_period": {"initial_loss_scale": 2.0**15,
                              "increment_period": 3, "multiplier": 2.0},
    "near_float32_max": {"initial_loss_scale": oracle.FLOAT32_MAX / 4,
                         "increment_period": 4, "multiplier": 1.5},
    "tiny_huge_multiplier": {"initial_loss_scale": 1e-30,
                             "increment_period": 7, "multiplier": 1e10},
}


def _warm_up_sequence(rng, params):
    """Steps that leave a changed scale and an unfinished period behind."""
    period = params["increment_period"]
    pattern = (oracle.random_finite_pattern(rng, 10) + [False]
               + [True] * int(rng.integers(1, period)))
    return oracle.random_sequence(
        rng, params=params, pattern=pattern,
        template=oracle.random_template_with_element(rng))


def _continuation_sequence(rng, params):
    """Steps after the restore; the first period is finite on purpose.

    The restored good-step count then decides when the scale grows.
    """
    period = params["increment_period"]
    pattern = [True] * period + [
        bool(x) for x in rng.random(3 * period + 10) >= 0.2]
    return oracle.random_sequence(
        rng, params=params, pattern=pattern,
        template=oracle.random_template_with_element(rng))


def _step(loss_scales, sequence):
    """Feeds `sequence` to existing loss scales, eagerly; returns the run."""
    return oracle.run_eager([lambda ls=ls: ls for ls in loss_scales],
                            sequence)


def _assert_nontrivial_state(scale, good_steps, params):
    # Restoring a state equal to a fresh object's would prove nothing.
    assert np.float32(scale) != np.float32(params["initial_loss_scale"])
    assert 0 < good_steps < params["increment_period"]


def _write(loss_scale, directory, name):
    return tf.train.Checkpoint(loss_scale=loss_scale).write(
        os.path.join(directory, name))


def _saved_state(path):
    return (tf.train.load_variable(path, SCALE_KEY),
            tf.train.load_variable(path, GOOD_STEPS_KEY))


def _assert_same_saved_state(path, expected_path):
    scale, good_steps = _saved_state(path)
    expected_scale, expected_good_steps = _saved_state(expected_path)
    assert scale.dtype == expected_scale.dtype == np.float32
    assert good_steps.dtype == expected_good_steps.dtype == np.int64
    oracle.assert_same_float32_bits(scale, expected_scale, "saved scale")
    assert good_steps == expected_good_steps


def _assert_runs_agree(run, context):
    first_scales, second_scales = run.scales
    oracle.assert_same_float32_bits(first_scales, second_scales, context)
    oracle.assert_same_flags(run.flags[0], run.flags[1], context)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_checkpoint_of_ours_restores_into_reference(name, tmp_path):
    params = PARAMS[name]
    rng = oracle.keyed_rng(SEED, 0, sorted(PARAMS).index(name))
    ours = tf_lossscale.DynamicLossScale(**params)
    _step([ours], _warm_up_sequence(rng, params))
    _assert_nontrivial_state(ours(), int(ours.good_steps), params)
    ours_path = _write(ours, tmp_path, "ours")

    reference = oracle.reference_dynamic(**params)
    tf.train.Checkpoint(loss_scale=reference).read(
        ours_path).assert_consumed()
    # The reference exposes no good-step count: re-saving it shows what it
    # holds now.
    _assert_same_saved_state(_write(reference, tmp_path, "reference"),
                             ours_path)

    run = _step([ours, reference], _continuation_sequence(rng, params))
    _assert_runs_agree(run, f"{name}, ours saved, reference restored")


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_checkpoint_of_reference_restores_into_ours(name, tmp_path):
    params = PARAMS[name]
    rng = oracle.keyed_rng(SEED, 1, sorted(PARAMS).index(name))
    reference = oracle.reference_dynamic(**params)
    _step([reference], _warm_up_sequence(rng, params))
    reference_path = _write(reference, tmp_path, "reference")
    saved_scale, saved_good_steps = _saved_state(reference_path)
    _assert_nontrivial_state(saved_scale, saved_good_steps, params)

    ours = tf_lossscale.DynamicLossScale(**params)
    tf.train.Checkpoint(loss_scale=ours).read(
        reference_path).assert_consumed()
    oracle.assert_same_float32_bits(ours().numpy(), saved_scale)
    assert ours.good_steps.dtype == tf.int64
    assert int(ours.good_steps) == saved_good_steps

    run = _step([reference, ours], _continuation_sequence(rng, params))
    _assert_runs_agree(run, f"{name}, reference saved, ours restored")


@pytest.mark.parametrize("attach_after_restore", [False, True],
                         ids=["attached_before", "attached_after"])
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_restored_copy_continues_where_original_would_have(
        name, attach_after_restore, tmp_path):
    params = PARAMS[name]
    rng = oracle.keyed_rng(SEED, 2, sorted(PARAMS).index(name))
    original = tf_lossscale.DynamicLossScale(**params)
    _step([original], _warm_up_sequence(rng, params))
    _assert_nontrivial_state(original(), int(original.good_steps), params)
    path = _write(original, tmp_path, "original")
    continuation = _continuation_sequence(rng, params)
    expected = _step([original], continuation)

    restored = tf_lossscale.DynamicLossScale(**params)
    if attach_after_restore:
        # As when an optimizer creates its loss scale lazily, after
        # `checkpoint.restore` was called: the restore is deferred.
        checkpoint = tf.train.Checkpoint()
        status = checkpoint.read(path)
        checkpoint.loss_scale = restored
    else:
        status = tf.train.Checkpoint(loss_scale=restored).read(path)
    status.assert_consumed()
    actual = _step([restored], continuation)
    oracle.assert_same_float32_bits(actual.scales[0], expected.scales[0],
                                    f"{name}, restored vs original")
    oracle.assert_same_flags(actual.flags[0], expected.flags[0], name)


class _Holder(tf.Module):
    """An optimizer-like parent, to check the keys of a nested loss scale."""

    def __init__(self, loss_scale):
        super().__init__()
        self.loss_scale = loss_scale


@pytest.mark.parametrize("nested", [False, True],
                         ids=["top_level", "inside_optimizer"])
def test_checkpoint_keys_and_dtypes_match_reference(nested, tmp_path):
    prefix = "optimizer/" if nested else ""

    def write(loss_scale, name):
        root = _Holder(loss_scale) if nested else loss_scale
        key = "optimizer" if nested else "loss_scale"
        return tf.train.Checkpoint(**{key: root}).write(
            os.path.join(tmp_path, name))

    ours_path = write(tf_lossscale.DynamicLossScale(), "ours")
    reference_path = write(oracle.reference_dynamic(), "reference")

    def variables(path):
        return {name: (shape, tf.train.load_variable(path, name).dtype)
                for name, shape in tf.train.list_variables(path)
                if name != "_CHECKPOINTABLE_OBJECT_GRAPH"}

    ours = variables(ours_path)
    assert ours == variables(reference_path)
    assert ours == {
        prefix + SCALE_KEY: ([], np.float32),
        prefix + GOOD_STEPS_KEY: ([], np.int64),
    }


class _Trainer(tf.Module):
    """A SavedModel-able owner of a loss scale with a traced update step."""

    def __init__(self, loss_scale):
        super().__init__()
        self.loss_scale = loss_scale

    @tf.function(input_signature=[
        tf.TensorSpec([None], tf.float32),
        tf.TensorSpec([None, 2], tf.float16),
    ])
    def step(self, dense, embedding_rows):
        grads = {
            "dense": dense,
            "embedding": tf.IndexedSlices(
                embedding_rows,
                tf.range(tf.shape(embedding_rows, out_type=tf.int64)[0]),
                tf.constant([8, 2], tf.int64)),
            "frozen": None,
        }
        _, should_apply = self.loss_scale.update(grads)
        return tf.convert_to_tensor(should_apply)

    @tf.function(input_signature=[])
    def scale(self):
        return self.loss_scale()


def _trainer_steps(rng, pattern):
    """Per step the arguments of `_Trainer.step`, non-finite where asked."""
    steps = []
    for finite in pattern:
        dense = rng.normal(size=int(rng.integers(1, 5))).astype(np.float32)
        rows = rng.normal(size=(int(rng.integers(1, 4)), 2)).astype(
            np.float16)
        if not finite:
            target = (dense, rows)[rng.integers(2)]
            target.flat[rng.integers(target.size)] = oracle.NON_FINITE_VALUES[
                rng.integers(3)]
        steps.append((dense, rows))
    return steps


def test_saved_model_keeps_updating_the_restored_state(tmp_path):
    params = PARAMS["small_multiplier_three"]
    rng = oracle.keyed_rng(SEED, 3)
    trainer = _Trainer(tf_lossscale.DynamicLossScale(**params))
    for dense, rows in _trainer_steps(rng, [True, False, True, True]):
        trainer.step(dense, rows)
    saved_scale = trainer.scale().numpy()
    saved_good_steps = int(trainer.loss_scale.good_steps)
    _assert_nontrivial_state(saved_scale, saved_good_steps, params)
    export_dir = os.path.join(tmp_path, "saved_model")
    tf.saved_model.save(trainer, export_dir)
    # The oracle starts from the same state, through a checkpoint.
    reference = oracle.reference_dynamic(**params)
    tf.train.Checkpoint(loss_scale=reference).read(
        _write(trainer.loss_scale, tmp_path, "ckpt")).assert_consumed()

    loaded = tf.saved_model.load(export_dir)
    oracle.assert_same_float32_bits(loaded.scale().numpy(), saved_scale)
    assert int(loaded.loss_scale.good_steps.numpy()) == saved_good_steps

    pattern = [True] * params["increment_period"] + [
        bool(x) for x in rng.random(20) >= 0.25]
    loaded_scales, loaded_flags, reference_scales, reference_flags = (
        [], [], [], [])
    for dense, rows in _trainer_steps(rng, pattern):
        loaded_flags.append(bool(loaded.step(dense, rows)))
        loaded_scales.append(loaded.scale().numpy())
        _, flag = reference.update([
            tf.constant(dense),
            tf.IndexedSlices(tf.constant(rows),
                             tf.range(rows.shape[0], dtype=tf.int64),
                             tf.constant([8, 2], tf.int64)),
        ])
        reference_flags.append(bool(flag))
        reference_scales.append(reference().numpy())
    oracle.assert_same_float32_bits(loaded_scales, reference_scales,
                                    "loaded SavedModel vs reference")
    oracle.assert_same_flags(loaded_flags, reference_flags)
    oracle.assert_same_flags(loaded_flags, pattern)
    # The updates landed in the loaded object's variables, not in a copy.
    oracle.assert_same_float32_bits(
        loaded.loss_scale.current_loss_scale.numpy(), reference().numpy())

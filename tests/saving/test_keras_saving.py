"""Saving and loading `tf_lossscale.LossScaleOptimizer`.

A saved optimizer must come back as this class with the same loss scale
parameters and, where Keras saves optimizer state, the same state: the scale,
the dynamic scale's good-steps counter, `skipped_steps` and `iterations`.
Otherwise training resumes with another scale than it stopped with, and the
next growth comes at another step.

Old configs (TF <= 2.3, tf-keras 2.4+, Keras 3) go through `from_config`.

A saved model that trains on is the uninterrupted run the loaded one must
follow; trained models and their saved files are shared by the cases that
read them.
"""

import functools
import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import training
from tests.helpers import models
import tf_lossscale
from tf_lossscale import LossScaleOptimizer

# Finite (True) and non-finite (False) training steps. The split leaves the
# good-steps counter above zero at the save, and the steps after it cross a
# growth boundary, so a lost counter shows as a growth at the wrong step.
_STEPS_BEFORE_SAVE = [True, False, True]
_STEPS_AFTER_LOAD = [True, True, True, False, True]
_LOSS_SCALE_CONFIG = {"initial_loss_scale": 2.0**8, "increment_period": 3,
                      "multiplier": 2.0}


# One xdist worker runs the file, so each shared model is trained once.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("keras_saving")]


def _optimizer(learning_rate=0.01):
    return LossScaleOptimizer(
        keras.optimizers.Adam(learning_rate),
        tf_lossscale.DynamicLossScale(**_LOSS_SCALE_CONFIG))


def _compiled_model(seed=0, jit_compile=False, learning_rate=0.01):
    model = models.tiny_model(seed)
    model.compile(_optimizer(learning_rate), "mse", jit_compile=jit_compile)
    return model


def _batch(step, finite):
    """Step `step`'s batch of 4, seeded by the step; a NaN if not finite."""
    return training.normal_data(4, seed=step, nan_batches=[] if finite else [0],
                            nan_row=2)


def _train(model, steps, first_step=0):
    # Under XLA the loss scale's checks run on the host after each call.
    train_on_batch = tf_lossscale.with_xla_checks(model.train_on_batch,
                                                  model.optimizer)
    for step, finite in enumerate(steps, start=first_step):
        train_on_batch(*_batch(step, finite))


def _state(model):
    """Everything that decides how training continues."""
    optimizer = model.optimizer
    return {
        "weights": [w.numpy() for w in model.weights],
        "slots": [v.numpy() for v in optimizer.inner_optimizer.variables],
        "scale": float(optimizer.loss_scale()),
        "good_steps": int(optimizer.loss_scale.good_steps),
        "skipped_steps": int(optimizer.skipped_steps),
        "iterations": int(optimizer.iterations),
    }


def _assert_same_state(actual, expected):
    assert actual.keys() == expected.keys()
    for key in actual:
        if key in ("weights", "slots"):
            assert len(actual[key]) == len(expected[key]), key
            for a, e in zip(actual[key], expected[key]):
                np.testing.assert_array_equal(a, e, err_msg=key)
        else:
            assert actual[key] == expected[key], key


def _assert_same_optimizer_config(restored, original):
    assert type(restored) is LossScaleOptimizer
    assert restored.name == original.name
    assert type(restored.loss_scale) is type(original.loss_scale)
    assert (restored.loss_scale.get_config()
            == original.loss_scale.get_config())
    assert (type(restored.inner_optimizer)
            is type(original.inner_optimizer))
    assert (restored.inner_optimizer.get_config()
            == original.inner_optimizer.get_config())


# ---------------------------------------------------------------------------
# The .keras format.


@pytest.mark.parametrize("xla", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_keras_file_resumes_training_exactly_where_it_stopped(
        policy, xla, tmp_path):
    keras.mixed_precision.set_global_policy(policy)
    # Saved, then trained on: the run the loaded model must follow.
    uninterrupted = _compiled_model(jit_compile=xla)
    _train(uninterrupted, _STEPS_BEFORE_SAVE)
    saved_state = _state(uninterrupted)
    path = str(tmp_path / "model.keras")
    uninterrupted.save(path)
    _assert_same_state(_state(uninterrupted), saved_state)

    loaded = keras.models.load_model(path)
    # The XLA step's record of events is not saved: the file is the same.
    if xla:
        loaded.compile(loaded.optimizer, "mse", jit_compile=True)

    _assert_same_optimizer_config(loaded.optimizer, uninterrupted.optimizer)
    _assert_same_state(_state(loaded), saved_state)
    assert saved_state["good_steps"] > 0 and saved_state["skipped_steps"] > 0
    for step, finite in enumerate(_STEPS_AFTER_LOAD,
                                  start=len(_STEPS_BEFORE_SAVE)):
        _train(loaded, [finite], first_step=step)
        _train(uninterrupted, [finite], first_step=step)
        _assert_same_state(_state(loaded), _state(uninterrupted))


# ---------------------------------------------------------------------------
# Config serialization.


_LOSS_SCALES = {
    "fixed": lambda: tf_lossscale.FixedLossScale(128.0),
    "dynamic": lambda: tf_lossscale.DynamicLossScale(64.0, 5, 3.0),
}
_SERIALIZERS = {
    "optimizers": (keras.optimizers.serialize, keras.optimizers.deserialize),
    "saving": (keras.saving.serialize_keras_object,
               keras.saving.deserialize_keras_object),
}


@pytest.mark.parametrize("loss_scale_name", sorted(_LOSS_SCALES))
@pytest.mark.parametrize("serializer_name", sorted(_SERIALIZERS))
def test_serialize_deserialize_round_trips_through_json(
        loss_scale_name, serializer_name):
    serialize, deserialize = _SERIALIZERS[serializer_name]
    original = LossScaleOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.5),
        _LOSS_SCALES[loss_scale_name](), name="scaled_sgd")

    restored = deserialize(json.loads(json.dumps(serialize(original))))

    _assert_same_optimizer_config(restored, original)


# ---------------------------------------------------------------------------
# tf.train.Checkpoint.


@pytest.fixture(scope="module")
def trained_model():
    """A model trained through _STEPS_BEFORE_SAVE, for tests that only read
    it."""
    model = _compiled_model()
    _train(model, _STEPS_BEFORE_SAVE)
    return model


def _restore_checkpoint_of(model, restored, directory):
    """Saves `model` and its optimizer in a checkpoint and restores it into
    `restored` (its optimizer built first), every value of it used."""
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(directory / "ckpt"))
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        path).assert_consumed()


def test_checkpoint_restores_loss_scale_and_optimizer_state(
        tmp_path, trained_model):
    model = trained_model
    restored = _compiled_model(seed=1)

    _restore_checkpoint_of(model, restored, tmp_path)

    _assert_same_state(_state(restored), _state(model))


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)


def test_checkpoint_restores_an_optimizer_with_a_learning_rate_schedule(
        tmp_path):
    model = _compiled_model(seed=0, learning_rate=_schedule())
    _train(model, _STEPS_BEFORE_SAVE)
    restored = _compiled_model(seed=1, learning_rate=_schedule())

    # The schedule is no variable: nothing of it is saved, nothing is left.
    _restore_checkpoint_of(model, restored, tmp_path)

    _assert_same_state(_state(restored), _state(model))
    assert float(restored.optimizer.learning_rate) == float(
        model.optimizer.learning_rate)


def test_checkpoint_holds_loss_scale_variables_under_loss_scale(
        tmp_path, trained_model):
    optimizer = trained_model.optimizer
    path = tf.train.Checkpoint(optimizer=optimizer).save(
        str(tmp_path / "ckpt"))
    values = {name: tf.train.load_variable(path, name)
              for name, _ in tf.train.list_variables(path)}
    suffix = "/.ATTRIBUTES/VARIABLE_VALUE"

    # tf-keras stored its loss scale under these names too.
    assert values["optimizer/loss_scale/current_loss_scale" + suffix] == (
        float(optimizer.loss_scale()))
    assert values["optimizer/loss_scale/good_steps" + suffix] == (
        int(optimizer.loss_scale.good_steps))
    assert not [name for name in values if "/_loss_scale/" in name]


def test_checkpoint_with_tf_keras_layout_restores_loss_scale(tmp_path):
    # The object layout of a tf-keras 2.4+ LossScaleOptimizer checkpoint:
    # optimizer -> loss_scale -> current_loss_scale, good_steps.
    tf_keras_loss_scale = tf.Module()
    tf_keras_loss_scale.current_loss_scale = tf.Variable(512.0)
    tf_keras_loss_scale.good_steps = tf.Variable(7, dtype=tf.int64)
    tf_keras_optimizer = tf.Module()
    tf_keras_optimizer.loss_scale = tf_keras_loss_scale
    path = tf.train.Checkpoint(optimizer=tf_keras_optimizer).save(
        str(tmp_path / "ckpt"))
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(), "dynamic")

    tf.train.Checkpoint(optimizer=optimizer).restore(path).expect_partial()

    assert float(optimizer.loss_scale()) == 512.0
    assert int(optimizer.loss_scale.good_steps) == 7


# ---------------------------------------------------------------------------
# model.save_weights / load_weights.


def _keras_loss_scale_optimizer():
    return keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=_LOSS_SCALE_CONFIG["initial_loss_scale"],
        dynamic_growth_steps=_LOSS_SCALE_CONFIG["increment_period"])


@pytest.fixture(scope="module")
def saved_weights(tmp_path_factory):
    """`make_optimizer -> (model, path)`: a model compiled with
    `make_optimizer()`, trained, its weights saved at `path`. One per
    optimizer, shared by both build orders."""
    directory = tmp_path_factory.mktemp("weights")

    @functools.cache
    def save(make_optimizer):
        model = models.tiny_model()
        model.compile(make_optimizer(), "mse")
        _train(model, _STEPS_BEFORE_SAVE)
        path = str(directory /
                   f"{type(model.optimizer).__module__}.weights.h5")
        model.save_weights(path)
        return model, path

    return save


def _save_and_load_weights(make_optimizer, build_before_load, saved_weights):
    """Trains, saves weights (`saved_weights`), loads them into a new model.

    Returns the trained model, the model loaded into, that model's state just
    before loading, and the warnings Keras gave while loading.
    """
    model, path = saved_weights(make_optimizer)
    loaded = models.tiny_model(seed=1)
    loaded.compile(make_optimizer(), "mse")
    if build_before_load:
        loaded.optimizer.build(loaded.trainable_variables)
    state_before_load = (_state(loaded)
                         if isinstance(loaded.optimizer, LossScaleOptimizer)
                         else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded.load_weights(path)
    return model, loaded, state_before_load, [str(w.message) for w in caught]


@pytest.mark.parametrize("build_before_load", [False, True],
                         ids=["unbuilt_optimizer", "built_optimizer"])
def test_load_weights_treats_optimizer_state_as_keras_does(
        build_before_load, saved_weights):
    keras_saved, keras_loaded, _, keras_warnings = _save_and_load_weights(
        _keras_loss_scale_optimizer, build_before_load, saved_weights)
    saved, loaded, before_load, our_warnings = _save_and_load_weights(
        _optimizer, build_before_load, saved_weights)
    keras_restored_optimizer = (
        int(keras_loaded.optimizer.iterations)
        == int(keras_saved.optimizer.iterations))

    for model, reloaded in ((keras_saved, keras_loaded), (saved, loaded)):
        for w, w_loaded in zip(model.weights, reloaded.weights):
            np.testing.assert_array_equal(w_loaded.numpy(), w.numpy())
    assert bool(our_warnings) == bool(keras_warnings)
    if build_before_load:
        # Keras restores a built optimizer; ours brings its scale along.
        assert keras_restored_optimizer
    if keras_restored_optimizer:
        _assert_same_state(_state(loaded), _state(saved))
    else:
        # Nothing of the optimizer is restored, not even the scale: a scale
        # from step k with the counters of step 0 would be inconsistent.
        expected = {**before_load, "weights": _state(saved)["weights"]}
        _assert_same_state(_state(loaded), expected)


# ---------------------------------------------------------------------------
# Configs written by earlier versions of Keras and TensorFlow.


def _sgd_config(**extra):
    return {"name": "SGD", "learning_rate": 0.01, "momentum": 0.9,
            "nesterov": False, **extra}


_TF_KERAS_2_11_BASE_KEYS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
    "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
}
_KERAS_3_BASE_KEYS = {
    "weight_decay": None, "clipnorm": None, "global_clipnorm": None,
    "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
    "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}

_LEGACY_CONFIGS = {
    "tf_keras_2_4_dynamic": (
        {"inner_optimizer": {"class_name": "SGD",
                             "config": _sgd_config(decay=0.0)},
         "dynamic": True, "initial_scale": 1024.0,
         "dynamic_growth_steps": 500},
        tf_lossscale.DynamicLossScale(1024.0, 500, 2.0)),
    "tf_keras_2_4_fixed": (
        {"inner_optimizer": {"class_name": "SGD",
                             "config": _sgd_config(decay=0.0)},
         "dynamic": False, "initial_scale": 128.0,
         "dynamic_growth_steps": None},
        tf_lossscale.FixedLossScale(128.0)),
    "tf_keras_2_11_new_optimizer": (
        {"inner_optimizer": {
            "module": "keras.optimizers", "class_name": "SGD",
            "config": _sgd_config(jit_compile=True, is_legacy_optimizer=False,
                                  **_TF_KERAS_2_11_BASE_KEYS),
            "registered_name": None},
         "dynamic": True, "initial_scale": 32768.0,
         "dynamic_growth_steps": 2000},
        tf_lossscale.DynamicLossScale(32768.0, 2000, 2.0)),
    "tf_keras_2_11_legacy_optimizer": (
        {"inner_optimizer": {
            "class_name": "SGD",
            "config": _sgd_config(decay=0.0, is_legacy_optimizer=True)},
         "dynamic": True, "initial_scale": 32768.0,
         "dynamic_growth_steps": 2000},
        tf_lossscale.DynamicLossScale(32768.0, 2000, 2.0)),
    "keras_3": (
        {"name": "loss_scale_optimizer",
         "inner_optimizer": {"module": "keras.optimizers",
                             "class_name": "SGD", "config": _sgd_config(),
                             "registered_name": None},
         "initial_scale": 512.0, "dynamic_growth_steps": 100},
        tf_lossscale.DynamicLossScale(512.0, 100, 2.0)),
    "keras_3_with_base_optimizer_keys": (
        {"name": "loss_scale_optimizer",
         "inner_optimizer": {"module": "keras.optimizers",
                             "class_name": "SGD", "config": _sgd_config(),
                             "registered_name": None},
         "initial_scale": 512.0, "dynamic_growth_steps": 100,
         **_KERAS_3_BASE_KEYS},
        tf_lossscale.DynamicLossScale(512.0, 100, 2.0)),
    "tf_2_3_dynamic": (
        {"optimizer": {"class_name": "SGD", "config": _sgd_config(decay=0.0)},
         "loss_scale": {"class_name": "DynamicLossScale",
                        "config": {"initial_loss_scale": 32768.0,
                                   "increment_period": 2000,
                                   "multiplier": 2.0}}},
        tf_lossscale.DynamicLossScale(32768.0, 2000, 2.0)),
    "tf_2_3_fixed": (
        {"optimizer": {"class_name": "SGD", "config": _sgd_config(decay=0.0)},
         "loss_scale": {"class_name": "FixedLossScale",
                        "config": {"loss_scale_value": 64.0}}},
        tf_lossscale.FixedLossScale(64.0)),
}


def _assert_loaded_as(optimizer, expected_loss_scale):
    assert type(optimizer) is LossScaleOptimizer
    assert type(optimizer.loss_scale) is type(expected_loss_scale)
    assert (optimizer.loss_scale.get_config()
            == expected_loss_scale.get_config())
    inner = optimizer.inner_optimizer
    assert type(inner) is keras.optimizers.SGD
    assert inner.get_config()["learning_rate"] == pytest.approx(0.01)
    assert inner.get_config()["momentum"] == pytest.approx(0.9)


# tf-keras 2.4 to 2.10 wrote `decay`, which Keras 3 ignores with a warning.
@pytest.mark.filterwarnings("ignore:Argument `decay` is no longer supported")
@pytest.mark.parametrize("name", sorted(_LEGACY_CONFIGS))
def test_legacy_config_loads_through_from_config(name):
    config, expected_loss_scale = _LEGACY_CONFIGS[name]

    optimizer = LossScaleOptimizer.from_config(json.loads(json.dumps(config)))

    _assert_loaded_as(optimizer, expected_loss_scale)


@pytest.mark.filterwarnings("ignore:Argument `decay` is no longer supported")
def test_legacy_serialized_optimizer_loads_with_custom_objects():
    # How a whole old `{"class_name": "LossScaleOptimizer", ...}` entry is
    # read: Keras would otherwise pick its own class of that name.
    config, expected_loss_scale = _LEGACY_CONFIGS["tf_keras_2_4_dynamic"]

    optimizer = keras.saving.deserialize_keras_object(
        {"class_name": "LossScaleOptimizer", "config": config},
        custom_objects={"LossScaleOptimizer": LossScaleOptimizer})

    _assert_loaded_as(optimizer, expected_loss_scale)


def test_keras_loss_scale_optimizer_config_loads_as_equivalent_optimizer():
    keras_optimizer = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.01, momentum=0.9), initial_scale=64.0,
        dynamic_growth_steps=7)

    optimizer = LossScaleOptimizer.from_config(keras_optimizer.get_config())

    _assert_loaded_as(optimizer, tf_lossscale.DynamicLossScale(
        keras_optimizer.initial_scale, keras_optimizer.dynamic_growth_steps,
        2.0))
    assert optimizer.name == keras_optimizer.name
    assert (optimizer.inner_optimizer.get_config()
            == keras_optimizer.inner_optimizer.get_config())


def test_legacy_config_with_non_default_base_optimizer_key_is_rejected():
    config, _ = _LEGACY_CONFIGS["keras_3"]

    with pytest.raises(ValueError, match="clipnorm=1.0"):
        LossScaleOptimizer.from_config({**config, "clipnorm": 1.0})

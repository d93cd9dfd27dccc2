"""Saved state is a promise: files written by earlier versions still load.

`tests/fixtures/` holds, per released state layout, a `.keras` file, a
`tf.train.Checkpoint` and serialized configs, written by
`tests/fixtures/make_fixtures.py` with that version's code, and the values it
recorded. Each test loads one of them with the current code and checks every
value bit for bit: loading does not depend on the machine. Then (for the
model) it takes one more step and checks that training continues exactly as
it would have: bit for bit like a fresh model set to the recorded values and
stepped on this machine. The weights the fixture recorded after that step
are not the reference: matmul and reduction kernels round differently on
other CPUs (AVX-512 or not) and TensorFlow versions. The fresh models (the
reference, the one a checkpoint is read into) are made once and set back to
their values as built before each use, so that each traces its step once.
"""

import json
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests.fixtures import make_fixtures
from tests import helpers
from tests.helpers.training import values_of

# One xdist worker runs the file, so each shared model is built once.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("saved_state_fixtures")]

FIXTURES = helpers.FIXTURES
# v0_1: written by the 0.1.0 release. v0_2: written by the 0.2.0 release
# (commit 2f3d353), whose checkpoints hold the inner optimizer's state under
# the plain names too, before 0.3.0 added the wrapper's `_variables` to them.
# v0_3: written by the 0.3.0 release (commit c4ddea4, TF 2.21.0, Keras
# 3.15.1), before 0.4.0 moved the loss scales into modules of their own.
# v0_4: written by the 0.4.0 release (commit 4ef8ac3, TF 2.21.0, Keras
# 3.15.1), before 0.5.0 moved the package into folders and rewrote saving.
# v0_5: written by the 0.5.0 release (commit bd361bd, TF 2.21.0, Keras
# 3.15.1), before 0.6.0 added shared loss scales and per-layer scaling.
VERSIONS = ("v0_1", "v0_2", "v0_3", "v0_4", "v0_5")


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


def _state_after(model, optimizer, step_batch):
    """Trains one step on `step_batch`; returns the loss and what decides
    how training continues."""
    loss = model.train_on_batch(*step_batch)
    return {
        "loss": loss,
        **{f"optimizer_{key}": value for key, value
           in make_fixtures.optimizer_state(optimizer).items()},
        **{f"weight_{i}": w.numpy() for i, w in enumerate(model.weights)},
        **{f"slot_{i}": s for i, s
           in enumerate(make_fixtures.inner_slots(optimizer))},
    }


@pytest.fixture(scope="module")
def fresh_compiled_model():
    """`use -> (model, optimizer)`: `make_fixtures.compiled_model()` under the
    global policy, its optimizer built, every variable set back to its value
    as built at each call. One per use and policy."""
    made = {}

    def fresh(use):
        key = use, keras.mixed_precision.global_policy().name
        if key not in made:
            model, optimizer = make_fixtures.compiled_model()
            optimizer.build(model.trainable_variables)
            state = model.weights + optimizer.variables
            made[key] = model, optimizer, state, values_of(state)
        model, optimizer, state, values = made[key]
        for variable, value in zip(state, values, strict=True):
            variable.assign(value)
        # The loss of the next step alone: Keras 3.10's `train_on_batch`
        # keeps the loss's running mean across calls (3.15's resets it).
        model.reset_metrics()
        return model, optimizer

    return fresh


def _assert_next_step_as_on_this_machine(model, optimizer, expected,
                                         fresh_compiled_model):
    """One more step from the loaded state equals the same step taken here
    by a fresh model assigned the recorded values."""
    reference, reference_optimizer = fresh_compiled_model("reference")
    make_fixtures.assign_recorded_state(reference, reference_optimizer,
                                        expected)
    _assert_state_as_recorded(reference, reference_optimizer, expected)
    step_batch = make_fixtures.batch(len(make_fixtures.FINITE_SCHEDULE))

    loaded_after = _state_after(model, optimizer, step_batch)
    reference_after = _state_after(reference, reference_optimizer, step_batch)

    assert loaded_after.keys() == reference_after.keys()
    for key, value in loaded_after.items():
        _assert_equal(value, reference_after[key], f"{key} after one more step")
    # The step was applied and moved the weights: comparing two models that
    # both skipped or stood still would prove nothing.
    assert loaded_after["optimizer_iterations"] == (
        expected["optimizer_iterations"] + 1)
    assert not np.array_equal(loaded_after["weight_0"], expected["weight_0"])


def _keras_series_of(path):
    """The release series of the Keras that wrote the `.keras` file."""
    with zipfile.ZipFile(path) as archive:
        version = json.loads(archive.read("metadata.json"))["keras_version"]
    return tuple(int(part) for part in version.split(".")[:2])


def _load_model_file(path, fresh_compiled_model):
    """The model of the `.keras` file at `path`, compiled with its optimizer.

    Keras reads the model configs of files that it or an older Keras wrote;
    an older one rejects arguments added since (these files' Keras 3.15
    configs name `quantization_config` and initializers' `input_axes`). With
    such a Keras, the model is built as the fixture's was and the file's
    weights, the optimizer's state included, are loaded into it.
    """
    running = tuple(int(part) for part in keras.__version__.split(".")[:2])
    if running >= _keras_series_of(path):
        return keras.models.load_model(path)
    model, _ = fresh_compiled_model("loaded")
    model.load_weights(path)
    return model


@pytest.mark.parametrize("version", VERSIONS)
def test_keras_file_loads_with_recorded_state_and_trains_on(
        version, fresh_compiled_model):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _load_model_file(FIXTURES / f"model_{version}.keras",
                             fresh_compiled_model)
    assert isinstance(model.optimizer, tf_lossscale.LossScaleOptimizer)
    expected = _expected(version)
    _assert_state_as_recorded(model, model.optimizer, expected)
    _assert_next_step_as_on_this_machine(model, model.optimizer, expected,
                                         fresh_compiled_model)


@pytest.mark.parametrize("version", VERSIONS)
def test_checkpoint_restores_recorded_state_and_trains_on(
        version, fresh_compiled_model):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, optimizer = fresh_compiled_model("restored")
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(
        str(FIXTURES / f"checkpoint_{version}" / "model")).assert_consumed()
    expected = _expected(version)
    _assert_state_as_recorded(model, optimizer, expected)
    _assert_next_step_as_on_this_machine(model, optimizer, expected,
                                         fresh_compiled_model)


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

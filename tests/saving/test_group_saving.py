"""A `LossScaleGroup`'s state in files and checkpoints, bit for bit.

A GAN (`tests/helpers/gan.py`) trained in mixed_float16 through a skipped
step, then one optimizer stepped once more (an iteration left open, so that
the group's own state is not zero), is saved as a `.keras` file, a
`.weights.h5` file and a `tf.train.Checkpoint`, and read into a fresh GAN
with a fresh group: every value (weights, both inner optimizers' variables,
the shared scale and its counter, the open iteration, each optimizer's
skipped steps) comes back bit for bit, and the next iteration continues as
the original's does. The 0.5.0 fixtures (one optimizer, no group) restore
into an optimizer given a group.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests import helpers
from tests.fixtures import make_fixtures
from tests.helpers import gan

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("group_saving")]

_BATCH = 8


def _state(model, group, optimizers):
    return {
        "weights": [np.array(w) for w in model.get_weights()],
        "inner": [gan.inner_values(o) for o in optimizers],
        "shared": [v.numpy() for v in (*group.loss_scale.variables,
                                       *group.variables)],
        "skipped": [o.skipped_steps.numpy() for o in optimizers],
    }


def _assert_same(actual, expected):
    for key in expected:
        for a, e in zip(tf.nest.flatten(actual[key]),
                        tf.nest.flatten(expected[key])):
            np.testing.assert_array_equal(a, e, err_msg=key)


def _next_iteration(model, optimizers):
    """The open iteration's missing step (the generator's), then a whole
    iteration; eagerly, so that both models run the same kernels."""
    d, g = optimizers
    g.apply([tf.ones_like(v) for v in model.generator.trainable_variables],
            model.generator.trainable_variables)
    model.train_on_batch(gan.dataset(gan.data(1, _BATCH, seed=5),
                                     _BATCH).get_single_element())
    del d


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, group, optimizers = make_fixtures.group_gan()
    model.fit(gan.dataset(gan.data(3, _BATCH, poison_batches=[1]), _BATCH),
              verbose=0)
    # The discriminator steps once more: an iteration left open.
    d_variables = model.discriminator.trainable_variables
    optimizers[0].apply([tf.ones_like(v) for v in d_variables], d_variables)
    state = _state(model, group, optimizers)
    assert [int(v) for v in group.variables] == [0b01, 0]
    assert [int(s) for s in state["skipped"]] == [0, 1]
    folder = tmp_path_factory.mktemp("group")
    paths = {"keras": str(folder / "gan.keras"),
             "h5": str(folder / "gan.weights.h5")}
    model.save(paths["keras"])
    model.save_weights(paths["h5"])
    paths["checkpoint"] = tf.train.Checkpoint(
        model=model, d=optimizers[0], g=optimizers[1]).write(
            str(folder / "ckpt"))
    _next_iteration(model, optimizers)
    after = _state(model, group, optimizers)
    keras.mixed_precision.set_global_policy("float32")
    return paths, state, after


@pytest.mark.parametrize("kind", ["keras", "h5", "checkpoint"])
def test_the_group_state_comes_back_bit_for_bit_and_trains_on(saved, kind):
    paths, state, after = saved
    keras.mixed_precision.set_global_policy("mixed_float16")
    model, group, optimizers = make_fixtures.group_gan()
    if kind == "checkpoint":
        tf.train.Checkpoint(model=model, d=optimizers[0],
                            g=optimizers[1]).read(paths[kind]).expect_partial()
    else:
        model.load_weights(paths[kind])
    _assert_same(_state(model, group, optimizers), state)
    _next_iteration(model, optimizers)
    _assert_same(_state(model, group, optimizers), after)


def test_the_0_5_checkpoint_and_file_restore_into_a_grouped_optimizer():
    expected = np.load(helpers.FIXTURES / "expected_v0_5.npz")
    keras.mixed_precision.set_global_policy("mixed_float16")
    for kind in ("checkpoint", "keras"):
        net = make_fixtures.model()
        group = tf_lossscale.LossScaleGroup(make_fixtures.loss_scale())
        optimizer = tf_lossscale.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), loss_scale=group)
        net.compile(optimizer=optimizer, loss="mse")
        optimizer.build(net.trainable_variables)
        if kind == "checkpoint":
            # Every value of the file is used; the group's own variables
            # are not in it (assert_consumed would name them).
            tf.train.Checkpoint(model=net, optimizer=optimizer).read(str(
                helpers.FIXTURES / "checkpoint_v0_5" / "model")
            ).expect_partial()
        else:
            net.load_weights(helpers.FIXTURES / "model_v0_5.keras")
        for key, value in make_fixtures.optimizer_state(optimizer).items():
            np.testing.assert_array_equal(value, expected[f"optimizer_{key}"],
                                          err_msg=f"{kind} {key}")
        # The group's own state starts afresh.
        assert [int(v) for v in group.variables] == [0, 0]

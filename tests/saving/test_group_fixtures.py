"""A `LossScaleGroup`'s saved state is a promise too: the files 0.6 wrote load.

`tests/fixtures/group_*_v0_6*` were written by
`python tests/fixtures/make_fixtures.py v0_6 group` before the group moved out
of `loss_scales/`: a GAN whose two optimizers share a group, with an open
iteration. Each is loaded into fresh objects and every value checked bit for
bit against the recorded ones; then the next iteration from the loaded state
must equal, bit for bit, the same iteration run on this machine by a fresh GAN
assigned the recorded values (the weights the fixture recorded after it are
the recording machine's, never compared).
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tests import helpers
from tests.fixtures import make_fixtures

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("group_fixtures")]

VERSION = "v0_6"
FIXTURES = helpers.FIXTURES


def _expected():
    with np.load(FIXTURES / f"group_expected_{VERSION}.npz") as data:
        return {key: value for key, value in data.items()
                if not key.startswith("weight_after_")}


def _assert_as(actual, expected, when):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(actual[key], value,
                                      err_msg=f"{key} {when}")


def _fresh():
    keras.mixed_precision.set_global_policy("mixed_float16")
    return make_fixtures.group_gan()


def _assert_trains_on_as_here(net, group, optimizers):
    expected = _expected()
    reference = _fresh()
    make_fixtures.assign_recorded_group_state(*reference, expected)
    _assert_as(make_fixtures.group_state(*reference), expected, "assigned")
    make_fixtures.group_next_iteration(net, optimizers)
    make_fixtures.group_next_iteration(reference[0], reference[2])
    after = make_fixtures.group_state(net, group, optimizers)
    _assert_as(after, make_fixtures.group_state(*reference),
               "after the next iteration")
    # Both iterations were taken and applied: comparing two GANs that stood
    # still would prove nothing.
    assert after["g_inner_0"] == expected["g_inner_0"] + 2
    assert not np.array_equal(after["weight_0"], expected["weight_0"])


@pytest.mark.parametrize("kind", ["keras", "checkpoint"])
def test_the_gan_loads_with_recorded_state_and_trains_on(kind):
    net, group, optimizers = _fresh()
    if kind == "checkpoint":
        tf.train.Checkpoint(model=net, d=optimizers[0], g=optimizers[1]).read(
            str(FIXTURES / f"group_checkpoint_{VERSION}" / "gan")
        ).expect_partial()
    else:
        net.load_weights(FIXTURES / f"group_{VERSION}.keras")
    _assert_as(make_fixtures.group_state(net, group, optimizers),
               _expected(), "as loaded")
    _assert_trains_on_as_here(net, group, optimizers)


def test_the_group_checkpoint_restores_the_shared_state():
    group = tf_lossscale.LossScaleGroup(
        tf_lossscale.DynamicLossScale(2.0**12, 2))
    tf.train.Checkpoint(group=group).read(
        str(FIXTURES / f"group_checkpoint_{VERSION}" / "group")
    ).assert_consumed()
    expected = _expected()
    values = [v.numpy() for v in (*group.loss_scale.variables,
                                  *group.variables)]
    for value, key in zip(values, ("loss_scale", "good_steps",
                                   "iteration_members_stepped",
                                   "iteration_overflowed"), strict=True):
        np.testing.assert_array_equal(value, expected[key], err_msg=key)


def test_the_configs_load_as_the_same_objects():
    configs = json.loads(
        (FIXTURES / f"group_configs_{VERSION}.json").read_text())
    optimizer = keras.optimizers.deserialize(configs["d_optimizer"])
    assert isinstance(optimizer, tf_lossscale.LossScaleOptimizer)
    assert isinstance(optimizer.loss_scale_group, tf_lossscale.LossScaleGroup)
    assert tf_lossscale.serialize(optimizer.loss_scale) == configs["group"]
    assert keras.optimizers.serialize(optimizer)["config"] == (
        configs["d_optimizer"]["config"])
    group = tf_lossscale.deserialize(configs["group"])
    assert isinstance(group, tf_lossscale.LossScaleGroup)
    assert tf_lossscale.serialize(group) == configs["group"]
    assert tf_lossscale.get(configs["group"]).get_config() == (
        configs["group"]["config"])

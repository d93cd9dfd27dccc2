"""`LossScaleMonitor(optimizers=...)`: a custom `train_step`'s optimizers.

Optimizers sharing a `LossScaleGroup` log `loss_scale` once; optimizers with
loss scales of their own log one each, under their labels; every optimizer
logs its skipped steps, and `verbose` names it in its lines. The journey of
a GAN whose optimizers share a group: `tests/keras/test_several_optimizers.py`.
"""

import keras
import pytest

import tf_lossscale
from tests.helpers import gan

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _optimizers(loss_scales):
    return [tf_lossscale.LossScaleOptimizer(gan.inner_optimizer(keras),
                                            loss_scale=loss_scale)
            for loss_scale in loss_scales]


def test_optimizers_with_loss_scales_of_their_own_log_each_under_its_label(
        capsys):
    optimizers = _optimizers([tf_lossscale.DynamicLossScale(2.0**10),
                              tf_lossscale.DynamicLossScale(2.0**12)])
    monitor = tf_lossscale.LossScaleMonitor(
        verbose=True, optimizers={"critic": optimizers[0],
                                  "maker": optimizers[1]})
    steps = gan.fit(keras, gan.build(keras, gan.initial_weights(keras)),
                    optimizers, gan.data(3, 8, poison_batches=[1]), 8,
                    callbacks=[monitor])
    assert [step["logs"] for step in steps][-1] == {
        "critic_loss_scale": 2.0**10, "maker_loss_scale": 2.0**11,
        "critic_skipped_steps": 0, "maker_skipped_steps": 1}
    printed = capsys.readouterr().out
    assert ("LossScaleMonitor: maker: skipped step 2; loss scale 4096.0 -> "
            "2048.0") in printed, printed
    assert "critic:" not in printed


@pytest.mark.parametrize("optimizers, error, match", [
    ("d", TypeError, "optimizers must be a dict of labels"),
    ([], ValueError, "at least one optimizer"),
    ({"d": keras.optimizers.SGD()}, TypeError,
     r"optimizers\['d'\] is <keras"),
    ({1: None}, TypeError, "an optimizers label must be a string"),
])
def test_refused_optimizers(optimizers, error, match):
    with pytest.raises(error, match=match):
        tf_lossscale.LossScaleMonitor(optimizers=optimizers)
    with pytest.raises(error, match=match):
        tf_lossscale.XlaChecks(optimizers=optimizers)


def test_two_optimizers_of_one_name_and_gradient_stats_of_two_are_refused():
    group = tf_lossscale.LossScaleGroup()
    first, second = _optimizers([group, group])
    second.name = first.name
    with pytest.raises(ValueError, match="each under a label of its own"):
        tf_lossscale.LossScaleMonitor(optimizers=[first, second])
    with pytest.raises(ValueError, match="gradient_stats=True watches one"):
        tf_lossscale.LossScaleMonitor(gradient_stats=True,
                                      optimizers={"a": first, "b": second})

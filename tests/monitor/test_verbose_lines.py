"""`LossScaleMonitor(verbose=True)`: what bounds a burst, how many variables
a line names, and how steps are numbered (docs/guides/monitoring.md)."""

import keras
import pytest

import tf_lossscale
from tf_lossscale.monitor import callback as monitor

from tests.helpers import models  # pylint: disable=g-bad-import-order
from tests.helpers import training  # pylint: disable=g-bad-import-order

pytestmark = pytest.mark.usefixtures("keras_isolation")

_BATCH_SIZE = 8


def _monitor_lines(text):
    return [line for line in text.splitlines()
            if line.startswith("LossScaleMonitor:")]


def _fit(model, nan_steps, steps, epochs=1):
    x, y = training.summed_data(_BATCH_SIZE, steps,
                                nan_batches=[step - 1 for step in nan_steps])
    model.fit(x, y, batch_size=_BATCH_SIZE, epochs=epochs, shuffle=False,
              verbose=0,
              callbacks=[tf_lossscale.LossScaleMonitor(verbose=True)])


@pytest.mark.parametrize("apart, one_burst", [
    (monitor.BURST_GAP_STEPS, True),
    (monitor.BURST_GAP_STEPS + 1, False),
])
def test_verbose_joins_skips_at_most_the_gap_apart_in_one_burst(
        apart, one_burst, capsys):
    # Two NaN steps `apart` steps apart (docs/guides/monitoring.md).
    second = 1 + apart
    model = models.mixed_float16_model(1024.0)

    _fit(model, [1, second], second + 3)

    assert int(model.optimizer.skipped_steps) == 2
    assert [line.split(";")[0] for line in _monitor_lines(
        capsys.readouterr().out)] == (
            ["LossScaleMonitor: skipped step 1",
             f"LossScaleMonitor: 1 more skipped step in step {second}"]
            if one_burst else
            ["LossScaleMonitor: skipped step 1",
             f"LossScaleMonitor: skipped step {second}"])


def test_verbose_names_at_most_five_variables_and_counts_the_rest(capsys):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,))] + [
        keras.layers.Dense(2) for _ in range(4)])  # 8 variables
    model.compile(tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01), tf_lossscale.DynamicLossScale(1024.0)),
                  loss="mse")

    _fit(model, [1], 2)  # NaN input: every gradient is NaN.

    paths = [v.path for v in model.trainable_variables]
    assert model.optimizer.last_nonfinite_variables() == paths
    (line,) = _monitor_lines(capsys.readouterr().out)
    assert line.split("non-finite gradients: ")[1] == (
        ", ".join(paths[:5]) + f" and {len(paths) - 5} more")


def test_verbose_numbers_steps_across_epochs_and_from_1_in_each_fit(capsys):
    model = models.mixed_float16_model(1024.0)

    # Four steps an epoch, the second batch NaN: steps 2 and 6 of the fit.
    _fit(model, [2], 4, epochs=2)
    first_fit = _monitor_lines(capsys.readouterr().out)
    _fit(model, [2], 4)
    second_fit = _monitor_lines(capsys.readouterr().out)

    assert int(model.optimizer.skipped_steps) == 3
    assert [line.split(";")[0] for line in first_fit] == [
        "LossScaleMonitor: skipped step 2",
        "LossScaleMonitor: 1 more skipped step in step 6"]
    assert [line.split(";")[0] for line in second_fit] == [
        "LossScaleMonitor: skipped step 2"]

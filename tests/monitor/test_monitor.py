"""Tests of `LossScaleMonitor`: the loss scale and skipped steps in Keras' logs.

The runs start a dynamic loss scale at 2**30, far above what float16
gradients take, with growth out of reach (increment_period 10**6): every
skipped step halves the scale and nothing doubles it, so at every point
`loss_scale == 2**30 / 2**skipped_steps` exactly. Every logged pair is
checked against that and against the optimizer itself.
"""

import contextlib
import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale.monitor import callback as monitor

from tests.helpers import training  # pylint: disable=g-bad-import-order
from tests.helpers import models  # pylint: disable=g-bad-import-order

# One xdist worker runs the file: its module fixtures run once.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("monitor_fit_runs")]

_INITIAL_SCALE = 2.0**30
_KERAS_SERIES = tuple(int(part) for part in keras.__version__.split(".")[:2])
_BATCH_SIZE = 8
_STEPS_PER_EPOCH = 8
_EPOCHS = 3


def _batches_of_steps(steps):
    """The batch indices of Keras' 1-based step numbers in an epoch."""
    return [step - 1 for step in steps]


class _BatchLogs(keras.callbacks.Callback):
    """Copies what later callbacks see at each batch end."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append((batch, dict(logs)))


def _events(logdir):
    """{tag: [(step, value), ...]} from Keras' TensorBoard training events."""
    tags = {}
    for path in tf.io.gfile.glob(f"{logdir}/train/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalar = float(tf.make_ndarray(value.tensor))
                tags.setdefault(value.tag, []).append((event.step, scalar))
    return tags


def _scale_matches_count(scale, skipped):
    return scale == _INITIAL_SCALE / 2**skipped


_FIT_RUNS = {
    # name: (mirrored, steps_per_execution, jit_compile)
    "one_device": (False, 1, False),
    "mirrored_2_devices": (True, 4, False),
    "xla": (False, 1, True),
    "xla_4_steps_per_call": (False, 4, True),
}


@pytest.fixture(scope="module", params=_FIT_RUNS)
def fit_run(request, tmp_path_factory):
    """One fit with the monitor, then History, CSVLogger, TensorBoard and a
    batch-log recorder: on one device (steps_per_execution 1), under
    MirroredStrategy on 2 logical CPUs with steps_per_execution 4, and
    under XLA on one device (XLA under Mirrored cannot run on logical CPUs)
    with steps_per_execution 1 and 4. The monitor alone runs the checks an
    XLA step leaves to the host."""
    mirrored, steps_per_execution, jit_compile = _FIT_RUNS[request.param]
    strategy = training.mirrored(2) if mirrored else None
    tmp = tmp_path_factory.mktemp(request.param)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = models.mixed_float16_model(
            _INITIAL_SCALE, jit_compile=jit_compile,
            steps_per_execution=steps_per_execution)
    batch_logs = _BatchLogs()
    x, y = training.summed_data(_BATCH_SIZE, _STEPS_PER_EPOCH)
    history = model.fit(
        x, y, batch_size=_BATCH_SIZE, epochs=_EPOCHS, shuffle=False, verbose=0,
        callbacks=[tf_lossscale.LossScaleMonitor(), batch_logs,
                   keras.callbacks.CSVLogger(str(tmp / "log.csv")),
                   keras.callbacks.TensorBoard(str(tmp / "tb"), update_freq=1,
                                               write_graph=False)])
    optimizer = model.optimizer
    return {
        "steps_per_execution": steps_per_execution,
        "history": history.history,
        "batch_logs": batch_logs.logs,
        "csv": list(csv.DictReader((tmp / "log.csv").open())),
        "events": _events(tmp / "tb"),
        "final": (float(optimizer.loss_scale()),
                  int(optimizer.skipped_steps)),
    }


def test_every_batch_end_logs_the_current_scale_and_count(fit_run):
    batch_logs = fit_run["batch_logs"]
    spe = fit_run["steps_per_execution"]

    # One batch end per execution of steps_per_execution steps, named by its
    # last step (by its first before Keras 3.11).
    named = spe - 1 if _KERAS_SERIES >= (3, 11) else 0
    assert [batch for batch, _ in batch_logs] == list(
        range(named, _STEPS_PER_EPOCH, spe)) * _EPOCHS
    for _, logs in batch_logs:
        # Python numbers, not tensors or numpy scalars.
        assert (type(logs["loss_scale"]), type(logs["skipped_steps"])) == (
            float, int)
        assert _scale_matches_count(logs["loss_scale"], logs["skipped_steps"])
    counts = [logs["skipped_steps"] for _, logs in batch_logs]
    assert counts == sorted(counts)
    # The scale calibrated from 2**30 (some steps skipped) and then trained
    # (not every step skipped).
    assert 0 < counts[-1] < _STEPS_PER_EPOCH * _EPOCHS
    assert (batch_logs[-1][1]["loss_scale"],
            batch_logs[-1][1]["skipped_steps"]) == fit_run["final"]


def test_history_holds_each_epochs_final_scale_and_count(fit_run):
    history = fit_run["history"]
    batch_logs = fit_run["batch_logs"]
    executions = _STEPS_PER_EPOCH // fit_run["steps_per_execution"]
    epoch_ends = [logs for _, logs in batch_logs[executions - 1::executions]]

    assert history["loss_scale"] == [logs["loss_scale"] for logs in epoch_ends]
    assert history["skipped_steps"] == [
        logs["skipped_steps"] for logs in epoch_ends]
    assert (history["loss_scale"][-1],
            history["skipped_steps"][-1]) == fit_run["final"]
    assert all(np.isfinite(history["loss"]))


def test_csv_logger_after_the_monitor_has_both_columns(fit_run):
    rows = fit_run["csv"]

    assert [float(row["loss_scale"]) for row in rows] == (
        fit_run["history"]["loss_scale"])
    assert [int(row["skipped_steps"]) for row in rows] == (
        fit_run["history"]["skipped_steps"])


def test_tensorboard_after_the_monitor_writes_both_scalars(fit_run):
    events = fit_run["events"]
    history = fit_run["history"]

    assert [value for _, value in events["epoch_loss_scale"]] == (
        history["loss_scale"])
    assert [value for _, value in events["epoch_skipped_steps"]] == (
        history["skipped_steps"])
    logged = [(logs["loss_scale"], logs["skipped_steps"])
              for _, logs in fit_run["batch_logs"]]
    assert list(zip([v for _, v in events["batch_loss_scale"]],
                    [v for _, v in events["batch_skipped_steps"]])) == logged


def test_monitor_continues_from_the_saved_state_after_a_keras_reload(
        tmp_path):
    model = models.mixed_float16_model(_INITIAL_SCALE)
    x, y = training.summed_data(_BATCH_SIZE, _STEPS_PER_EPOCH)
    model.fit(x, y, batch_size=_BATCH_SIZE, epochs=1, shuffle=False,
              verbose=0, callbacks=[tf_lossscale.LossScaleMonitor()])
    saved_skips = int(model.optimizer.skipped_steps)
    path = tmp_path / "model.keras"
    model.save(path)

    reloaded = keras.models.load_model(path)
    batch_logs = _BatchLogs()
    history = reloaded.fit(
        x, y, batch_size=_BATCH_SIZE, epochs=1, shuffle=False, verbose=0,
        callbacks=[tf_lossscale.LossScaleMonitor(), batch_logs])

    assert saved_skips > 0
    first = batch_logs.logs[0][1]
    assert first["skipped_steps"] >= saved_skips
    for _, logs in batch_logs.logs:
        # Both the count and the scale came back: the relation still holds.
        assert _scale_matches_count(logs["loss_scale"], logs["skipped_steps"])
    assert (history.history["loss_scale"][-1],
            history.history["skipped_steps"][-1]) == (
                float(reloaded.optimizer.loss_scale()),
                int(reloaded.optimizer.skipped_steps))


@pytest.mark.parametrize("callback", ["LossScaleMonitor", "XlaChecks"])
@pytest.mark.parametrize("policy, expected", [
    ("float32", "keras.src.optimizers.sgd.SGD"),
    ("mixed_float16", "Keras wraps any other optimizer"),
])
def test_other_optimizer_fails_at_train_begin_naming_it(policy, expected,
                                                        callback):
    keras.mixed_precision.set_global_policy(policy)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    weights = [w.numpy() for w in model.weights]
    x, y = training.summed_data(_BATCH_SIZE, _STEPS_PER_EPOCH)

    with pytest.raises(TypeError, match="tf_lossscale.LossScaleOptimizer") as e:
        model.fit(x, y, batch_size=_BATCH_SIZE, epochs=1, verbose=0,
                  callbacks=[getattr(tf_lossscale, callback)()])

    assert expected in str(e.value)
    assert "SGD" in str(e.value)
    # Nothing trained before the error.
    assert int(model.optimizer.iterations) == 0
    for before, after in zip(weights, model.weights):
        np.testing.assert_array_equal(before, after.numpy())


def test_verbose_must_be_a_bool():
    with pytest.raises(TypeError, match="verbose"):
        tf_lossscale.LossScaleMonitor(verbose=1)


# Verbose mode. These need LossScaleOptimizer.last_nonfinite_variables().


def _monitor_lines(text):
    return [line for line in text.splitlines()
            if line.startswith("LossScaleMonitor:")]


def test_verbose_prints_a_burst_once_and_its_summary_then_a_lone_skip(capsys):
    # NaN steps, so the skips fall exactly there: a burst of 5 from step 1,
    # and step 40, far enough after it to start a burst of its own.
    model = models.mixed_float16_model(1024.0)
    x, y = training.summed_data(
        _BATCH_SIZE, 48, nan_batches=_batches_of_steps([1, 2, 3, 4, 5, 40]))

    model.fit(x, y, batch_size=_BATCH_SIZE, epochs=1, shuffle=False,
              verbose=0,
              callbacks=[tf_lossscale.LossScaleMonitor(verbose=True)])

    # NaN inputs make every gradient NaN.
    every_variable = ", ".join(v.path for v in model.trainable_variables)
    assert int(model.optimizer.skipped_steps) == 6
    assert _monitor_lines(capsys.readouterr().out) == [
        "LossScaleMonitor: skipped step 1; loss scale 1024.0 -> 512.0; "
        f"non-finite gradients: {every_variable}",
        "LossScaleMonitor: 4 more skipped steps in steps 2-5; "
        "loss scale 512.0 -> 32.0",
        "LossScaleMonitor: skipped step 40; loss scale 32.0 -> 16.0; "
        f"non-finite gradients: {every_variable}",
    ]


def test_verbose_names_the_steps_of_each_execution(capsys):
    # Four steps per execution over ten: the skip at step 6 is seen at the
    # end of steps 5-8, the one at step 10 at the end of steps 9-10, whatever
    # step number Keras passes the batch end.
    model = models.mixed_float16_model(
        1024.0, steps_per_execution=4)
    x, y = training.summed_data(
        _BATCH_SIZE, 10, nan_batches=_batches_of_steps([6, 10]))

    model.fit(x, y, batch_size=_BATCH_SIZE, epochs=1, shuffle=False,
              verbose=0,
              callbacks=[tf_lossscale.LossScaleMonitor(verbose=True)])

    assert int(model.optimizer.skipped_steps) == 2
    assert [line.split(";")[0] for line in _monitor_lines(
        capsys.readouterr().out)] == [
            "LossScaleMonitor: skipped 1 of steps 5-8",
            "LossScaleMonitor: 1 more skipped step in steps 9-10",
        ]


def test_verbose_names_only_the_overflowing_float16_layer(capsys):
    # At 2**30 the float16 layer's gradients overflow; the float32 output
    # layer's do not.
    model = models.mixed_float16_model(_INITIAL_SCALE)
    x, y = training.summed_data(_BATCH_SIZE)

    model.fit(x, y, batch_size=_BATCH_SIZE, epochs=1, shuffle=False,
              verbose=0,
              callbacks=[tf_lossscale.LossScaleMonitor(verbose=True)])

    float16_layer, float32_layer = model.layers
    (line,) = _monitor_lines(capsys.readouterr().out)
    named = line.split("non-finite gradients: ")[1].split(", ")
    assert float16_layer.kernel.path in named
    assert float32_layer.kernel.path not in named
    assert named == model.optimizer.last_nonfinite_variables()


def test_verbose_summarizes_a_burst_that_does_not_end(capsys, monkeypatch):
    monkeypatch.setattr(monitor, "BURST_SUMMARY_SKIPS", 3)
    model = models.mixed_float16_model(2.0**10)
    x, y = training.summed_data(_BATCH_SIZE, _STEPS_PER_EPOCH,
                            nan_batches=range(_STEPS_PER_EPOCH))

    model.fit(x, y, batch_size=_BATCH_SIZE, epochs=1, shuffle=False,
              verbose=0,
              callbacks=[tf_lossscale.LossScaleMonitor(verbose=True)])

    lines = _monitor_lines(capsys.readouterr().out)
    # 8 skipped steps: one line for step 1, then a summary per 3 skips, and
    # the remaining 1 when training ends.
    assert [line.split(";")[0] for line in lines] == [
        "LossScaleMonitor: skipped step 1",
        "LossScaleMonitor: 3 more skipped steps in steps 2-4",
        "LossScaleMonitor: 3 more skipped steps in steps 5-7",
        "LossScaleMonitor: 1 more skipped step in step 8",
    ]
    assert lines[-1].endswith("loss scale 8.0 -> 4.0")

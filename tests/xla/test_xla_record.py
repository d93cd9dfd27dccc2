"""The record an XLA step writes for the host: never saved, and how often
the host reads it.

The record is not state: checkpoints, `.keras` files and TF1 graphs hold
exactly what they held before it existed (the fixtures tests load the
files of earlier releases). A read is one small device-to-host copy of the
record (`StepRecord.take`): at most one per executed call for all the
host-side checks together, and none before any step of the loss scale has
been traced under XLA; the counts here are the ones the XLA guide states.
"""

import os
import zipfile

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import models
import tf_lossscale
from tf_lossscale.loss_scales import xla_record

pytestmark = pytest.mark.usefixtures("keras_isolation")

_BATCH = 8


@pytest.fixture
def reads(monkeypatch):
    """The list of records read, one entry per read."""
    taken = []
    take = xla_record.StepRecord.take

    def counted(record):
        taken.append(record)
        return take(record)

    monkeypatch.setattr(xla_record.StepRecord, "take", counted)
    return taken


def _compiled(jit_compile=True, steps_per_execution=1, **loss_scale_args):
    model = models.tiny_model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        loss_scale=tf_lossscale.DynamicLossScale(**loss_scale_args))
    model.compile(optimizer, "mse", jit_compile=jit_compile,
                  steps_per_execution=steps_per_execution)
    return model, optimizer


def _fit(model, batches, callbacks=()):
    x = np.ones((batches * _BATCH, 3), np.float32)
    y = np.ones((batches * _BATCH, 1), np.float32)
    model.fit(x, y, batch_size=_BATCH, shuffle=False, verbose=0,
              callbacks=list(callbacks))


@pytest.mark.parametrize("watcher", ["XlaChecks", "LossScaleMonitor"])
def test_a_watched_fit_reads_once_per_call_and_once_at_its_end(reads,
                                                              watcher):
    model, _ = _compiled(steps_per_execution=2, max_consecutive_skips=3)
    # 6 batches, 2 steps per call: 3 calls.
    _fit(model, 6, [getattr(tf_lossscale, watcher)()])
    # The monitor reads the scale at the epoch's end too.
    per_epoch = 1 if watcher == "LossScaleMonitor" else 0
    assert len(reads) == 3 + per_epoch + 1  # + finalize_variable_values.
    del reads[:]
    _fit(model, 6, [getattr(tf_lossscale, watcher)()])
    # + once when the next fit begins (what an unwatched call left).
    assert len(reads) == 1 + 3 + per_epoch + 1


def test_with_xla_checks_reads_once_per_call(reads):
    model, optimizer = _compiled(on_min_loss_scale="raise")
    train_on_batch = tf_lossscale.with_xla_checks(model.train_on_batch,
                                                  optimizer)
    x, y = np.ones((_BATCH, 3), np.float32), np.ones((_BATCH, 1), np.float32)
    for _ in range(4):
        train_on_batch(x, y)
    assert len(reads) == 4


def test_the_default_scale_is_read_at_the_end_of_fit_and_reads_of_the_scale(
        reads):
    model, optimizer = _compiled()
    _fit(model, 5)
    assert len(reads) == 1  # finalize_variable_values, not per call.
    float(optimizer.loss_scale())
    assert len(reads) == 2


def test_nothing_is_read_without_xla(reads):
    model, optimizer = _compiled(jit_compile=False, on_min_loss_scale="raise")
    _fit(model, 3, [tf_lossscale.XlaChecks()])
    float(optimizer.loss_scale())
    tf_lossscale.with_xla_checks(lambda: None, optimizer)()
    assert not reads


# ---------------------------------------------------------------------------
# Not state.


_STATE = ["consecutive_skips", "current_loss_scale", "good_steps",
          "hysteresis_remaining"]


def _xla_step(optimizer, model):
    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
            scaled = optimizer.scale_loss(loss)
        optimizer.apply_gradients(zip(
            tape.gradient(scaled, model.trainable_variables),
            model.trainable_variables))

    return tf_lossscale.with_xla_checks(step, optimizer)


def _h5_keys(path, tmp_path):
    with zipfile.ZipFile(path) as archive:
        archive.extract("model.weights.h5", tmp_path)
    keys = []
    with h5py.File(os.path.join(tmp_path, "model.weights.h5")) as store:
        store.visititems(lambda name, item: keys.append(name))
    return sorted(keys)


def test_checkpoints_and_keras_files_hold_no_record(tmp_path):
    model, optimizer = _compiled(hysteresis=2, on_min_loss_scale="raise")
    loss_scale = optimizer.loss_scale
    assert sorted(v.name.split(":")[0] for v in loss_scale.variables) == (
        _STATE)
    x, y = np.ones((_BATCH, 3), np.float32), np.ones((_BATCH, 1), np.float32)
    before = os.path.join(tmp_path, "before.keras")
    _fit(model, 1, [tf_lossscale.XlaChecks()])
    model.save(before)
    _xla_step(optimizer, model)(x, y)
    assert loss_scale._xla_record.traced  # pylint: disable=protected-access
    after = os.path.join(tmp_path, "after.keras")
    model.save(after)
    assert _h5_keys(after, tmp_path) == _h5_keys(before, tmp_path)

    path = tf.train.Checkpoint(loss_scale=loss_scale).write(
        os.path.join(tmp_path, "ckpt"))
    names = sorted(name.split("/")[1] for name, _ in
                   tf.train.list_variables(path) if name.startswith("loss"))
    assert names == _STATE


def test_a_tf1_graph_makes_no_record():
    with tf.Graph().as_default():
        loss_scale = tf_lossscale.DynamicLossScale(
            hysteresis=2, on_min_loss_scale="raise")
        assert loss_scale._xla_record.variable is None  # pylint: disable=protected-access
        # What a default Saver saves, under the names it saves them by.
        assert sorted(v.op.name for v in tf.compat.v1.global_variables()) == (
            _STATE)

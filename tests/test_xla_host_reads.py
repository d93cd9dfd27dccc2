"""How often the host reads an XLA step's record: the counts the XLA guide
states, per way of watching.

A read is one small device-to-host copy of the record (`StepRecord.take`).
At most one per executed call for all the host-side checks together; none
before any step of the loss scale has been traced under XLA.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_models
import tf_lossscale
from tf_lossscale import xla_record

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
    model = keras_models.tiny_model()
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

"""`LossScaleMonitor(gradient_stats=True)`: per-step float16 figures in
Keras' logs, measured in the train step.

Each logged pair is checked against the same step's float16 gradients
computed here (a gradient tape over the model at the scale the step ran
with; under MirroredStrategy, each replica's half of the batch with its
loss halved, as `fit` computes it), with the definitions of the docs:

* `grad_underflow_share`: the share of the float16 layers' gradient values
  that are zero or below 2**-14 at that scale;
* `grad_headroom_log2`: log2(65504 / the largest of them at that scale).

And the option costs nothing when off: a step traced without it holds
exactly the ops it holds with it, minus the statistics' own.
"""

import contextlib
import csv
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale.monitor import gradient_stats as step_gradient_stats

from tests.helpers import training  # pylint: disable=g-bad-import-order
from tests.helpers import models  # pylint: disable=g-bad-import-order

# One xdist worker runs the file: its module fixtures run once.
pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("monitor_gradient_stats_runs")]

_BATCH = 8
_INITIAL_SCALE = 2.0**16
_STEPS = 6


def _expected_fn(model, replicas, jit_compile=False):
    """`(x, y) -> (share, headroom)` of the step `fit` is about to run on
    `(x, y)`, at the scale it will run with.

    The gradients are computed the way `fit` computes them: in a
    `tf.function` (graph rewrites fuse kernels, which may round otherwise
    than eager ops on some CPUs), under XLA where `fit` uses XLA (which may
    drop a float16 rounding between float32 ops: TF 2.16 does, so a
    gradient that overflows float16 elsewhere stays finite there). Traced
    once per fit (the scale is an argument, read like fit's from a
    variable): a trace per step would cost an XLA compile per step.
    """
    half = model.get_layer("half").trainable_weights

    @tf.function(jit_compile=jit_compile)
    def grads(part_x, part_y, scale):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(
                part_y, model(part_x, training=True)))
            scaled = loss * (1.0 / replicas) * scale
        return tape.gradient(scaled, half)

    def expected(x, y):
        scale = tf.constant(float(model.optimizer.loss_scale()))
        values = []
        for part_x, part_y in zip(np.split(x, replicas),
                                  np.split(y, replicas)):
            values += [np.ravel(g) for g in grads(part_x, part_y, scale)]
        values = np.abs(np.concatenate(values))
        headroom = (math.log2(65504.0) - math.log2(float(values.max()))
                    if np.isfinite(values).all() else -math.inf)
        return float(np.mean(values < 2.0**-14)), headroom

    return expected


class _Expect(keras.callbacks.Callback):
    """Before each batch, the figures its step should log; after it, what
    the callbacks after the monitor saw."""

    def __init__(self, x, y, replicas, jit_compile=False):
        super().__init__()
        self._x, self._y, self._replicas = x, y, replicas
        self._jit_compile = jit_compile
        self._expected = None
        self.expected, self.logged = [], []

    def on_train_begin(self, logs=None):
        self._expected = _expected_fn(self.model, self._replicas,
                                      self._jit_compile)

    def on_train_batch_begin(self, batch, logs=None):
        rows = slice(batch * _BATCH, (batch + 1) * _BATCH)
        self.expected.append(self._expected(self._x[rows], self._y[rows]))

    def on_train_batch_end(self, batch, logs=None):
        self.logged.append((logs["grad_underflow_share"],
                            logs["grad_headroom_log2"]))


_RUNS = {"one_device": (1, False), "xla": (1, True), "mirrored_2": (2, False)}


@pytest.fixture(scope="module", params=_RUNS)
def stats_run(request, tmp_path_factory):
    replicas, jit_compile = _RUNS[request.param]
    strategy = training.mirrored(replicas) if replicas > 1 else None
    with strategy.scope() if strategy else contextlib.nullcontext():
        # At 2**16 some steps' gradients go beyond float16's range (and
        # skip, halving the scale), others fit.
        model = models.mixed_float16_model(
            _INITIAL_SCALE, jit_compile=jit_compile)
    x, y = training.summed_data(_BATCH, _STEPS)
    expect = _Expect(x, y, replicas, jit_compile)
    tmp = tmp_path_factory.mktemp(request.param)
    history = model.fit(
        x, y, batch_size=_BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[tf_lossscale.LossScaleMonitor(gradient_stats=True),
                   expect, keras.callbacks.CSVLogger(str(tmp / "log.csv"))])
    return {"expect": expect, "history": history.history,
            "csv": list(csv.DictReader((tmp / "log.csv").open())),
            "model": model}


def test_each_step_logs_its_float16_gradients_share_and_headroom(stats_run):
    expect = stats_run["expect"]

    assert len(expect.logged) == _STEPS
    assert expect.logged == expect.expected
    headrooms = [headroom for _, headroom in expect.logged]
    # Steps beyond float16's range (-inf where they overflowed; TF 2.16's
    # XLA keeps them finite in float32) and steps that fit: not a trivial
    # run.
    assert any(headroom < 0 for headroom in headrooms)
    assert any(0 < headroom < math.inf for headroom in headrooms)
    assert all(isinstance(v, float) for pair in expect.logged for v in pair)


def test_history_and_csv_after_the_monitor_have_the_last_steps_figures(
        stats_run):
    last = stats_run["expect"].logged[-1]
    history = stats_run["history"]

    assert (history["grad_underflow_share"][-1],
            history["grad_headroom_log2"][-1]) == last
    (row,) = stats_run["csv"]
    assert (float(row["grad_underflow_share"]),
            float(row["grad_headroom_log2"])) == pytest.approx(last)


def test_the_option_is_off_again_after_fit(stats_run):
    model = stats_run["model"]
    assert model.optimizer._gradient_stats is None  # pylint: disable=protected-access


def test_underflow_share_counts_values_below_float16_normals():
    # A scale of 2**-20 pushes nearly every gradient value below 2**-14.
    model = models.mixed_float16_model(2.0**-20)
    x, y = training.summed_data(_BATCH)
    expect = _Expect(x, y, 1)

    model.fit(x, y, batch_size=_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[tf_lossscale.LossScaleMonitor(gradient_stats=True),
                         expect])

    assert expect.logged == expect.expected
    assert expect.logged[0][0] > 0.9


class _KeepStats(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.stats = self.model.optimizer._gradient_stats  # pylint: disable=protected-access


@pytest.fixture(scope="module")
def fits_around_the_monitor():
    """One model fit three times: without the monitor (its step traced
    without the option), with it, then without it again after the record's
    values were set to a sentinel."""
    model = models.mixed_float16_model(_INITIAL_SCALE)
    x, y = training.summed_data(_BATCH, _STEPS)
    model.fit(x, y, batch_size=_BATCH, epochs=1, shuffle=False, verbose=0)
    expect, keep = _Expect(x, y, 1), _KeepStats()
    model.fit(x, y, batch_size=_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[tf_lossscale.LossScaleMonitor(gradient_stats=True),
                         expect, keep])
    sentinel = np.array([7.0, 9.0, 11.0], np.float32)
    keep.stats.values.assign(sentinel)
    model.fit(x, y, batch_size=_BATCH, epochs=1, shuffle=False, verbose=0)
    return {"expect": expect, "sentinel": sentinel,
            "after": keep.stats.values.numpy()}


def test_a_step_traced_before_the_monitor_is_traced_again_with_it(
        fits_around_the_monitor):
    expect = fits_around_the_monitor["expect"]

    assert len(expect.logged) == _STEPS
    assert expect.logged == expect.expected


def test_steps_after_the_monitors_fit_record_nothing(fits_around_the_monitor):
    np.testing.assert_array_equal(fits_around_the_monitor["after"],
                                  fits_around_the_monitor["sentinel"])


def test_gradient_stats_must_be_a_bool():
    with pytest.raises(TypeError, match="gradient_stats must be True or False"):
        tf_lossscale.LossScaleMonitor(gradient_stats=1)


# The option costs nothing when off.


def _op_types(graph_def):
    """Op type -> count over a graph and every function in its library."""
    counts = {}
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes += list(function.node_def)
    for node in nodes:
        counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def _stats_op_types(graph_def):
    counts = {}
    for node in graph_def.node:
        if "gradient_stats" in node.name:
            counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def _traced_step(model, x, y):
    optimizer = model.optimizer

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(
                y, model(x, training=True)))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    return step.get_concrete_function().graph.as_graph_def()


def test_a_step_traced_without_the_option_has_none_of_its_ops():
    model = models.mixed_float16_model(_INITIAL_SCALE)
    x, y = training.summed_data(_BATCH)
    model.optimizer.build(model.trainable_variables)
    off = _traced_step(model, x, y)
    stats = step_gradient_stats.attach(model.optimizer,
                                       model.trainable_variables)
    on = _traced_step(model, x, y)
    step_gradient_stats.detach(model.optimizer)
    off_again = _traced_step(model, x, y)

    own = _stats_op_types(on)
    assert own and not _stats_op_types(off)
    # On = off + the statistics' own ops, and nothing else changes (the
    # group that ends the step waits on one more op: same op types).
    with_own_removed = _op_types(on)
    for op, count in own.items():
        with_own_removed[op] -= count
    assert {op: n for op, n in with_own_removed.items() if n} == (
        _op_types(off))
    assert _op_types(off_again) == _op_types(off)
    # The record never reaches a step traced without it.
    assert stats.values.name not in str(off)

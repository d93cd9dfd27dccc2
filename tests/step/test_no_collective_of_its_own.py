"""Under a strategy, a loss-scaled step launches no collective beyond the
gradients' own all-reduce: the same count as the step without loss scaling.

Each collective is a launch and a synchronisation of every device (across
machines, a network round trip), so the count is what many GPUs pay. The
steps are traced, never run, under a MultiWorkerMirroredStrategy over two
logical CPUs, where every reduction is a collective op; every op of the
step's graph and of every function it calls is counted, both branches of
each `cond` included. That NaN on one replica still skips everywhere is
pinned by the distribution tests and the multi-worker scenarios.
"""

import functools

import keras
import pytest
import tensorflow as tf
import tf_keras

from tests.helpers import layerwise_models
import tf_lossscale
from tf_lossscale import layerwise
from tf_lossscale.compat.v1 import MixedPrecisionLossScaleOptimizer
from tf_lossscale.monitor import gradient_stats

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _collectives(graph_def):
    nodes = [*graph_def.node, *(node for function in graph_def.library.function
                                for node in function.node_def)]
    return sum(1 for node in nodes
               if node.op.startswith(("Collective", "Nccl")))


@functools.lru_cache(maxsize=None)
def _strategy():
    # A MultiWorkerMirroredStrategy of one worker over two local devices
    # (TensorFlow's own tests make it so, with this private constructor):
    # every reduction is a collective op. Traced only: the tests that run
    # steps use their own strategies.
    return tf.distribute.MultiWorkerMirroredStrategy._from_local_devices(  # pylint: disable=protected-access
        ["/cpu:0", "/cpu:1"])


def _keras_step(keras_module, make_optimizers, jit_compile=False,
                block=None, prepare=None):
    """Collectives in one traced custom step (`strategy.run`, a scaled loss
    when the first optimizer scales) of a two-layer model whose first and
    second layer each get one of the optimizers (or both get the one)."""
    strategy = _strategy()
    with strategy.scope():
        model = keras_module.Sequential([
            keras_module.Input((4,)), keras_module.layers.Dense(3),
            keras_module.layers.Dense(2)])
        optimizers = make_optimizers()
        variables = model.trainable_variables
        parts = ([variables] if len(optimizers) == 1
                 else [variables[:2], variables[2:]])
        for optimizer, part in zip(optimizers, parts):
            if hasattr(optimizer, "build"):  # Legacy ones build on demand.
                optimizer.build(part)
        if prepare is not None:
            prepare(optimizers, variables)

    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones([2, 4])))
            if isinstance(optimizers[0], tf_lossscale.LossScaleOptimizer):
                loss = (optimizers[0].scale_loss(loss)
                        if hasattr(optimizers[0], "scale_loss")
                        else optimizers[0].get_scaled_loss(loss))
        grads = tape.gradient(loss, parts)
        with block() if block else _nothing():
            for optimizer, g, v in zip(optimizers, grads, parts):
                optimizer.apply_gradients(zip(g, v))

    @tf.function(jit_compile=jit_compile)
    def step():
        strategy.run(replica_step)

    return _collectives(step.get_concrete_function().graph.as_graph_def())


class _nothing:  # pylint: disable=invalid-name
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _wrapped(make_inner, count=1, **kwargs):
    return lambda: [tf_lossscale.LossScaleOptimizer(make_inner(), **kwargs)
                    for _ in range(count)]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("loss_scale", ["dynamic", 1024.0])
def test_keras_3_wrapper_adds_none(loss_scale, jit_compile):
    plain = _keras_step(keras, lambda: [keras.optimizers.Adam()],
                        jit_compile)
    ours = _keras_step(keras, _wrapped(keras.optimizers.Adam,
                                       loss_scale=loss_scale), jit_compile)
    assert plain > 0
    assert ours == plain


def test_gradient_statistics_ride_the_gradients_all_reduce():
    plain = _keras_step(keras, lambda: [keras.optimizers.Adam()])

    def watch_every_variable(optimizers, variables):
        # What LossScaleMonitor(gradient_stats=True) does in `fit`.
        gradient_stats.attach(optimizers[0], variables, _strategy())

    ours = _keras_step(keras, _wrapped(keras.optimizers.Adam),
                       prepare=watch_every_variable)
    assert ours == plain


def test_keras_3s_own_wrapper_agrees_on_nothing_and_adds_none():
    # The baseline this package matches, without Keras 3's missed NaN.
    plain = _keras_step(keras, lambda: [keras.optimizers.Adam()])
    theirs = _keras_step(keras, lambda: [
        keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())])
    assert theirs == plain


@pytest.mark.parametrize("legacy", [False, True], ids=["optimizer", "legacy"])
def test_tf_keras_wrapper_adds_none(legacy):
    make = (tf_keras.optimizers.legacy.Adam if legacy
            else tf_keras.optimizers.Adam)
    plain = _keras_step(tf_keras, lambda: [make()])
    ours = _keras_step(tf_keras, _wrapped(make))
    assert plain > 0
    assert ours == plain


# skip="together" needs an iteration() block.
@pytest.mark.parametrize("skip, in_block", [
    ("each", False), ("each", True), ("together", True)])
def test_a_group_of_two_adds_none(skip, in_block):
    group = tf_lossscale.LossScaleGroup(skip=skip)
    plain = _keras_step(keras, lambda: [keras.optimizers.Adam(),
                                        keras.optimizers.Adam()])
    ours = _keras_step(
        keras, _wrapped(keras.optimizers.Adam, count=2, loss_scale=group),
        block=group.iteration if in_block else None)
    assert plain > 0
    assert ours == plain


def _tf1_step(make_optimizer):
    strategy = _strategy()
    graph = tf.Graph()
    with graph.as_default(), strategy.scope():
        variable = tf.Variable(tf.ones([3]))
        optimizer = make_optimizer()

        def replica_step():
            return optimizer.minimize(tf.reduce_sum(variable * variable))

        strategy.group(strategy.run(replica_step))
    return _collectives(graph.as_graph_def())


def test_compat_v1_wrapper_adds_none():
    make = lambda: tf.compat.v1.train.AdamOptimizer(0.1)  # pylint: disable=unnecessary-lambda-assignment
    plain = _tf1_step(make)
    ours = _tf1_step(lambda: MixedPrecisionLossScaleOptimizer(make(), "dynamic"))
    assert plain > 0
    assert ours == plain


def _scaled_model_step(model):
    """Collectives in one traced custom step of `model` (its compiled
    optimizer; Keras 3)."""
    strategy = _strategy()
    optimizer = model.optimizer
    variables = model.trainable_variables
    with strategy.scope():
        optimizer.build(variables)
    x = tf.ones([2, layerwise_models.FEATURES])

    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.cast(model(x, training=True), tf.float32))
            if isinstance(optimizer, tf_lossscale.LossScaleOptimizer):
                loss = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(loss, variables), variables)

    @tf.function
    def step():
        strategy.run(replica_step)

    return _collectives(step.get_concrete_function().graph.as_graph_def())


def test_a_model_scaled_per_layer_adds_none():
    with _strategy().scope():
        plain = layerwise_models.gained_model()
        plain.compile(layerwise_models.adam(), "mse")
        scaled = layerwise.scale_per_layer(layerwise_models.gained_model())
    assert scaled.gradient_factors()  # Segments, each agreed on.
    plain_count = _scaled_model_step(plain)
    assert plain_count > 0
    assert _scaled_model_step(scaled) == plain_count

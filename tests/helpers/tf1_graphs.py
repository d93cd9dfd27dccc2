"""Small TF1 graphs for the tests of `tf_lossscale.compat.v1`.

A `TrainGraph` holds a tiny model (a weight matrix and a bias), a feed for
its input, a global step and the train op of one loss-scaling optimizer
wrapper, all in a `tf.Graph` of its own. Tests run it in a Session and read
everything back as numpy values.
"""

import numpy as np
import tensorflow as tf

INPUT_SHAPE = (4, 3)
UNITS = 2


def adam():
    """The TF1 optimizer the TF1 wrapper's tests wrap: Adam, learning rate
    0.01 (its slots make skipped steps visible)."""
    return tf.compat.v1.train.AdamOptimizer(0.01)


def initial_values(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(INPUT_SHAPE[1], UNITS)).astype(np.float32),
            rng.normal(size=(UNITS,)).astype(np.float32))


def model_loss(kernel, bias, inputs):
    """A scalar float32 loss of a float16 computation, as in mixed precision:
    float32 variables, float16 activations and intermediate gradients, which
    overflow when the loss scale is too high."""
    half = tf.float16
    outputs = (tf.matmul(tf.cast(inputs, half), tf.cast(kernel, half))
               + tf.cast(bias, half))
    return tf.cast(tf.reduce_sum(tf.square(outputs)), tf.float32) / 8.0


class TrainGraph:
    """A model and `wrapper.minimize(loss, global_step)` in a new graph.

    Args:
      make_optimizer: called in the graph; returns the wrapper to train with.
      seed: picks the initial weights.
      scope: a variable-name prefix, so two models can share a graph.
      graph: the graph to build in (a new one if None).
      inputs: the input tensor (a new placeholder if None).
    """

    def __init__(self, make_optimizer, seed=0, scope="model", graph=None,
                 inputs=None):
        self.graph = graph or tf.Graph()
        kernel, bias = initial_values(seed)
        with self.graph.as_default():
            with tf.compat.v1.variable_scope(scope):
                self.kernel = tf.compat.v1.Variable(kernel, name="kernel")
                self.bias = tf.compat.v1.Variable(bias, name="bias")
                self.global_step = tf.compat.v1.Variable(0, dtype=tf.int64,
                                               name="global_step")
            if inputs is None:
                inputs = tf.compat.v1.placeholder(tf.float32, INPUT_SHAPE)
            self.inputs = inputs
            self.loss = model_loss(self.kernel, self.bias, inputs)
            self.optimizer = make_optimizer()
            self.train_op = self.optimizer.minimize(
                self.loss, global_step=self.global_step)
            self.state_tensors = self._state_tensors()

    @property
    def model_variables(self):
        return [self.kernel, self.bias]

    def _state_tensors(self):
        """Everything a step may change, by kind (read in this graph)."""
        # pylint: disable=protected-access
        inner = self.optimizer._optimizer.variables()
        return {
            "weights": self.model_variables,
            "global_step": self.global_step,
            # The wrapped optimizer's slots and other variables, by name.
            "inner_variables": inner,
            # What the wrapper adds: the loss scale's variables.
            "loss_scale_variables": self.optimizer.variables()[len(inner):],
            "scale": self.optimizer._loss_scale(),
        }


def feed(kind, rng):
    """An input batch: "finite", "nan", "inf", "-inf" (one such element), or
    "large" (finite inputs whose float16 gradients overflow at scales above
    about 2**13)."""
    values = rng.normal(size=INPUT_SHAPE).astype(np.float32)
    if kind == "large":
        return values * np.float32(8)
    if kind != "finite":
        values[tuple(rng.integers(0, n) for n in INPUT_SHAPE)] = {
            "nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
    return values


STATE = ("weights", "global_step", "inner_variables", "loss_scale_variables",
         "scale")


def assert_same_state(actual, expected, keys=STATE):
    """Bit for bit: what applied and skipped steps did must agree exactly."""
    for key in keys:
        a, e = actual[key], expected[key]
        if isinstance(a, list):
            assert len(a) == len(e), key
            for a_value, e_value in zip(a, e):
                np.testing.assert_array_equal(a_value, e_value, err_msg=key)
        else:
            np.testing.assert_array_equal(a, e, err_msg=key)


def run_steps(train, kinds, seed=0, checkpoint=None):
    """Initialises `train`'s variables and runs its train op once per feed
    kind in a new Session; returns the state after each step (numpy values).
    Saves all variables to `checkpoint` at the end if given."""
    with train.graph.as_default():
        saver = tf.compat.v1.train.Saver() if checkpoint else None
        init = tf.compat.v1.global_variables_initializer()
    rng = np.random.default_rng(seed)
    states = []
    with tf.compat.v1.Session(graph=train.graph) as session:
        session.run(init)
        for kind in kinds:
            session.run(train.train_op, {train.inputs: feed(kind, rng)})
            states.append(session.run(train.state_tensors))
        if saver is not None:
            saver.save(session, checkpoint)
    return states


def restored_state(make_optimizer, checkpoint):
    """The state of a new `TrainGraph(make_optimizer)` restored by a Saver."""
    train = TrainGraph(make_optimizer)
    with train.graph.as_default():
        saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session(graph=train.graph) as session:
        saver.restore(session, checkpoint)
        return session.run(train.state_tensors)

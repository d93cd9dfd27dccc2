"""The optimizer's step alone, on the fit MLP's gradients, per feature.

The fit sections time what users pay, but a feature that costs 1% of a
training step drowns in the noise of a shared machine. Here only the
optimizer's work runs: one `tf.function` per candidate makes gradients
shaped like the fit MLP's afresh on each call (as backprop does, so the
unscale can overwrite them in place, as in `fit`) and hands them to
`apply`. Candidates: plain SGD (the baseline), Keras 3's wrapper,
tf_lossscale, and tf_lossscale with one feature taken away
(`lsbench.ablations`), many calls each, in interleaved rounds. Reported in
CPU microseconds per call over plain SGD.
"""

import statistics

import keras
import tensorflow as tf

from lsbench import gradient_sets
from lsbench import timing

SGD = "plain SGD"


def _step(optimizer, shapes):
    base = gradient_sets.scaled_gradients(shapes)
    variables = gradient_sets.variables(shapes)
    if hasattr(optimizer, "scale_loss"):
        optimizer.scale_loss(tf.constant(1.0))  # The Keras 3 protocol.

    @tf.function
    def step(factor):
        optimizer.apply([grad * factor for grad in base], variables)

    one = tf.constant(1.0)
    return lambda: step(one)


def microseconds(makers, shapes, settings):
    """name -> CPU microseconds per call over plain SGD's, medians of
    per-round differences.

    Args:
      makers: name -> `make(inner_sgd)` returning the optimizer; plain SGD
        is added as the baseline.
      shapes: the variables' shapes.
      settings: the run's `lsbench.context.Settings`.
    """
    candidates = {SGD: _step(keras.optimizers.SGD(1e-9), shapes)}
    for name, make in makers.items():
        candidates[name] = _step(make(keras.optimizers.SGD(1e-9)), shapes)
    # Short turns, many rounds: load drifts less within a round.
    calls = 1 if settings.quick else 10
    samples = timing.interleaved(candidates, 4 * settings.step_rounds,
                                 calls).cpu
    return {name: 1e6 * statistics.median(
        value - base for value, base in zip(values, samples[SGD]))
            for name, values in samples.items()}

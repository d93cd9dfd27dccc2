"""Side-by-side cost of loss scaling, printed as ratios measured in one run.

Machines here are noisy, so absolute times mean little: every comparison runs
its candidates in interleaved rounds within the same process and reports the
median time per call of each and the ratio of medians.

1. `update` alone: tf_lossscale.DynamicLossScale vs TensorFlow's reference
   tf.compat.v1.mixed_precision.DynamicLossScale, on the same gradients, in
   a tf.function.
2. A whole mixed_float16 training step (forward, backward, Adam update) of a
   small MLP: with tf_lossscale.LossScaleOptimizer, with Keras 3's own
   keras.mixed_precision.LossScaleOptimizer, and with no loss scaling.
3. State: the bytes of variables each wrapper adds beyond the inner
   optimizer.

Run: python benchmarks/loss_scale_benchmark.py [--rounds=15 --calls=20]
"""

import os
import statistics
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import tf_lossscale

_ROUNDS = flags.DEFINE_integer("rounds", 15, "Interleaved timing rounds.")
_CALLS = flags.DEFINE_integer("calls", 20, "Calls per candidate per round.")
_SEED = 0


def _median_seconds_per_call(candidates, rounds, calls):
    """Times each candidate in interleaved rounds; returns name -> median."""
    samples = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()  # Trace and warm up outside the measurement.
    for _ in range(rounds):
        for name, fn in candidates.items():
            samples[name].append(timeit.timeit(fn, number=calls) / calls)
    return {name: statistics.median(times) for name, times in samples.items()}


def _report(title, medians, baseline):
    print(f"\n{title}")
    for name, seconds in medians.items():
        ratio = seconds / medians[baseline]
        print(f"  {name:<34} {seconds * 1e6:10.1f} us/call   "
              f"x{ratio:.3f} vs {baseline}")


def _gradients():
    """A ResNet-ish mix of 60 gradients, about 6.5M float32 values."""
    rng = np.random.default_rng(_SEED)
    shapes = [(3, 3, 64, 64)] * 20 + [(64,)] * 20 + [(512, 512)] * 18 + [
        (1000,), (512, 1000)]
    return [tf.constant(rng.standard_normal(s), tf.float32) for s in shapes]


def benchmark_update(rounds, calls):
    grads = _gradients()
    ours = tf_lossscale.DynamicLossScale()
    reference = tf.compat.v1.mixed_precision.DynamicLossScale()

    @tf.function
    def ours_update():
        return ours.update(grads)[1]

    @tf.function
    def reference_update():
        return reference.update(grads)[1]

    medians = _median_seconds_per_call(
        {"tf_lossscale update": lambda: ours_update().numpy(),
         "TF reference update": lambda: reference_update().numpy()},
        rounds, calls)
    _report("1. DynamicLossScale.update on 60 gradients (6.5M values)",
            medians, "TF reference update")


def _model():
    keras.utils.set_random_seed(_SEED)
    return keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])


def _train_step(model, optimizer, scale_loss):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def benchmark_training_step(rounds, calls):
    rng = np.random.default_rng(_SEED)
    x = tf.constant(rng.standard_normal((128, 256)), tf.float32)
    y = tf.constant(rng.integers(0, 10, 128))
    steps = {}
    wrappers = {
        "tf_lossscale LossScaleOptimizer": tf_lossscale.LossScaleOptimizer,
        "keras LossScaleOptimizer": keras.mixed_precision.LossScaleOptimizer,
    }
    for name, wrapper in wrappers.items():
        optimizer = wrapper(keras.optimizers.Adam())
        steps[name] = _train_step(_model(), optimizer, optimizer.scale_loss)
    steps["no loss scaling"] = _train_step(
        _model(), keras.optimizers.Adam(), lambda loss: loss)
    medians = _median_seconds_per_call(
        {name: (lambda s=step: s(x, y).numpy()) for name, step in steps.items()},
        rounds, calls)
    _report("2. mixed_float16 training step, MLP 256-512-512-10, batch 128",
            medians, "no loss scaling")


def benchmark_state():
    print("\n3. Variables a wrapper adds beyond its inner optimizer")
    variables = [tf.Variable(tf.zeros([4, 4]))]
    for name, wrapper in (
            ("tf_lossscale", tf_lossscale.LossScaleOptimizer),
            ("keras", keras.mixed_precision.LossScaleOptimizer)):
        optimizer = wrapper(keras.optimizers.Adam())
        optimizer.build(variables)
        inner = {id(v) for v in optimizer.inner_optimizer.variables}
        added = [v for v in optimizer.variables if id(v) not in inner]
        # tf_lossscale keeps the scale's state in its LossScale object.
        loss_scale = getattr(optimizer, "loss_scale", None)
        added += list(getattr(loss_scale, "variables", ()))
        nbytes = sum(np.asarray(v.numpy()).nbytes for v in added)
        names = ", ".join(v.name for v in added)
        print(f"  {name:<14} {len(added)} scalar variables, {nbytes} bytes "
              f"({names})")


def main(argv):
    del argv
    keras.mixed_precision.set_global_policy("mixed_float16")
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
          f"{os.cpu_count()} CPUs; median of {_ROUNDS.value} interleaved "
          f"rounds x {_CALLS.value} calls")
    benchmark_update(_ROUNDS.value, _CALLS.value)
    benchmark_training_step(_ROUNDS.value, _CALLS.value)
    benchmark_state()


if __name__ == "__main__":
    app.run(main)

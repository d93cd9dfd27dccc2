"""The Keras 3 models the tests train: tiny and seeded, so that every weight
can be compared exactly."""

import keras

import tf_lossscale


def tiny_model(seed=0, hidden_units=4):
    """Dense(hidden_units) then Dense(1) on 3 features, seeded weights."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(hidden_units),
        keras.layers.Dense(1),
    ])


def mixed_float16_model(initial_scale, jit_compile=False,
                        steps_per_execution=1):
    """A compiled model with a float16 layer and a float32 one, seed 0.

    Dense(8, relu) in mixed_float16 named "half", then Dense(1) in float32
    named "full" (whose gradients float16 figures leave out), on 3 features;
    SGD(0.01) in a `LossScaleOptimizer` whose `DynamicLossScale` starts at
    `initial_scale` and does not grow within a test (increment_period
    10**6); mean squared error.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(8, activation="relu", dtype="mixed_float16",
                           name="half"),
        keras.layers.Dense(1, dtype="float32", name="full"),
    ])
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        tf_lossscale.DynamicLossScale(initial_scale, increment_period=10**6))
    model.compile(optimizer, "mse", jit_compile=jit_compile,
                  steps_per_execution=steps_per_execution)
    return model

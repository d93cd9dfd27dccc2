"""The tiny Keras model the Keras tests train: fast, and small enough that
every weight can be compared exactly."""

import keras


def tiny_model(seed=0, hidden_units=4):
    """Dense(hidden_units) then Dense(1) on 3 features, seeded weights."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(hidden_units),
        keras.layers.Dense(1),
    ])

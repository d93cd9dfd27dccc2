"""Keras runs that fail on purpose: the failure policy's and the XLA checks'.

A mixed_float16 `models.tiny_model()` with SGD(0.1) in a
`LossScaleOptimizer`, trained by `fit` with the `XlaChecks` callback in each
of `FIT_MODES`, on batches of `BATCH_SIZE` whose NaN makes every gradient
non-finite.
"""

import re

import keras
import numpy as np

from tests.helpers import training
from tests.helpers import models
import tf_lossscale

BATCH_SIZE = 8

FIT_MODES = {
    "eager": dict(run_eagerly=True),
    "tf_function": dict(run_eagerly=False, jit_compile=False),
    "xla": dict(jit_compile=True),
    "xla_2_steps_per_call": dict(jit_compile=True, steps_per_execution=2),
}
"""`model.compile` arguments of each way `fit` runs a step."""


def scale_state(loss_scale):
    """{name without suffix: value} of every state variable."""
    return {re.sub(r"(_\d+)?:\d+$", "", v.name): v.numpy().item()
            for v in loss_scale.variables}


def nan_batches(num_batches):
    """`num_batches` copies of one batch, each with a NaN input."""
    x, y = training.normal_data(BATCH_SIZE)
    x = np.tile(x, (num_batches, 1))
    y = np.tile(y, (num_batches, 1))
    x[::BATCH_SIZE, 0] = np.nan
    return x, y


def compiled(loss_scale, compile_args):
    """The model and its optimizer, compiled with `compile_args` under the
    mixed_float16 policy (the caller's test gives the policy back)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = models.tiny_model()
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), loss_scale=loss_scale)
    model.compile(optimizer, "mse", **compile_args)
    return model, optimizer


def fit(model, x, y):
    """One epoch in order; under XLA a policy that asks for failures needs a
    watcher, and without XLA the callback reads nothing and does nothing."""
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, shuffle=False,
              verbose=0, callbacks=[tf_lossscale.XlaChecks()])

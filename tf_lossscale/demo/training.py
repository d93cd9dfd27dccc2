"""The demo's training run: devices, synthetic data, the model, `run`.

Trains a small classifier in `mixed_float16` on synthetic data drawn from the
config's seed (see the package docstring for what the loss scale does), with
`LossScaleMonitor` in the callbacks, and returns a `DemoResult`.
"""

import contextlib
import dataclasses
import importlib

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale
from tf_lossscale.demo import config as config_lib
from tf_lossscale.demo import plot as plot_lib


class MissingExtraError(ImportError):
    """An optional package a flag needs is not installed."""


# Optional extras: flag -> (extra, the package it installs).
_EXTRAS = {"--plot": ("plot", "matplotlib"),
           "--logdir": ("tensorboard", "tensorboard")}


def require_extra(flag):
    """Raises `MissingExtraError` if the package `flag` needs is missing."""
    extra, package = _EXTRAS[flag]
    try:
        importlib.import_module(package)
    except ImportError as err:
        raise MissingExtraError(
            f"{flag} needs {package}, which is not installed: "
            f'pip install "tf_lossscale[{extra}]" (in a source checkout: '
            f'pip install -e ".[{extra}]")') from err


# Devices and data.


def configure_devices(num_devices):
    """Splits the CPU into `num_devices` logical devices unless it has enough
    (possible only before TensorFlow initialises its devices)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or [cpu]) >= (
            num_devices):
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    except RuntimeError as err:
        raise RuntimeError(
            f"num_devices={num_devices} needs that many logical CPU devices; "
            "call configure_devices before TensorFlow initialises its "
            "devices") from err


def make_strategy(num_devices):
    """MirroredStrategy over the first `num_devices` CPUs; None for one.

    Reducing through one device, not collectives, lets `run` be called again
    in one process with another device count (tests/support/strategies.py
    says why).
    """
    if num_devices == 1:
        return None
    return tf.distribute.MirroredStrategy(
        [f"/cpu:{index}" for index in range(num_devices)],
        cross_device_ops=tf.distribute.ReductionToOneDevice())


def synthetic_data(config):
    """`(features, labels)` from `config["seed"]`: standard normal features,
    labels from a random linear teacher, so the classes are learnable."""
    rng = np.random.default_rng(config["seed"])
    features = rng.standard_normal(
        (config["num_examples"], config["input_dim"])).astype(np.float32)
    teacher = rng.standard_normal((config["input_dim"], config["num_classes"]))
    labels = np.argmax(features @ teacher, axis=1).astype(np.int32)
    return features, labels


def training_dataset(features, labels, batch_size, steps,
                     inject_nonfinite_every=0):
    """Exactly `steps` batches, cycling through the examples in order.

    With `inject_nonfinite_every=N` > 0, the first feature of the last
    example of every N-th batch is NaN. A distributed dataset hands out a
    batch in consecutive slices, so that example goes to the last replica.
    """
    dataset = (tf.data.Dataset.from_tensor_slices((features, labels))
               .repeat().batch(batch_size, drop_remainder=True).take(steps))
    if inject_nonfinite_every:
        nan = np.zeros((batch_size, features.shape[1]), np.float32)
        nan[-1, 0] = np.nan
        dataset = dataset.enumerate(start=1).map(lambda step, batch: (
            tf.where(step % inject_nonfinite_every == 0, batch[0] + nan,
                     batch[0]), batch[1]))
    return dataset.prefetch(tf.data.AUTOTUNE)


# The model and the training run.


def build_model(config):
    """A one-hidden-layer classifier computing in float16 (`mixed_float16`:
    float32 weights); the process-wide dtype policy is left alone."""
    seed = config["seed"]
    inputs = keras.Input((config["input_dim"],))
    hidden = keras.layers.Dense(
        config["hidden_units"], activation="relu", dtype="mixed_float16",
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed))(inputs)
    logits = keras.layers.Dense(
        config["num_classes"], dtype="mixed_float16",
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1))(
            hidden)
    # float16 probabilities round small ones to 0, and the loss takes logs.
    probabilities = keras.layers.Activation("softmax", dtype="float32")(logits)
    return keras.Model(inputs, probabilities)


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What a demo run ended with. Steps are numbered from 1; `final_loss`
    is the mean loss over the whole (clean) dataset; `loss_scales` holds the
    scale before step 1, then after each step."""

    final_loss_scale: float
    skipped_steps: int
    skipped_at: tuple
    injected_at: tuple
    applied_steps: int
    weights_finite: bool
    final_loss: float
    loss_scales: tuple = ()

    @property
    def organic_skipped_steps(self):
        """Skipped steps that overflowed on their own, without an injection."""
        return len(set(self.skipped_at) - set(self.injected_at))

    def summary(self):
        """The demo's last output line."""
        return (f"final loss scale: {self.final_loss_scale}, "
                f"skipped steps: {self.skipped_steps}, "
                f"weights finite: {self.weights_finite}")

    def details(self):
        """A line with the counts behind the summary and the final loss."""
        return (f"applied steps: {self.applied_steps}, "
                f"injected non-finite steps: {len(self.injected_at)}, "
                f"skipped at steps: {list(self.skipped_at)} "
                f"({self.organic_skipped_steps} not injected), "
                f"final loss: {self.final_loss:.4f}")


class _Recorder(keras.callbacks.Callback):
    """Keeps the scale and the skipped steps that `LossScaleMonitor` logs."""

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        self.loss_scales = [float(optimizer.loss_scale())]
        self.skipped_at = []
        self._skipped = int(optimizer.skipped_steps)

    def on_train_batch_end(self, batch, logs=None):
        self.loss_scales.append(logs["loss_scale"])
        if logs["skipped_steps"] > self._skipped:
            self.skipped_at.append(batch + 1)
        self._skipped = logs["skipped_steps"]


def _train(config, steps, strategy, inject_every, verbose, logdir, log_skips):
    features, labels = synthetic_data(config)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = build_model(config)
        inner = config_lib.inner_optimizer(config["optimizer"])
        inner.learning_rate = config["learning_rate"]
        optimizer = tf_lossscale.LossScaleOptimizer(
            inner, loss_scale=config_lib.loss_scale(config["loss_scale"]))
        model.compile(optimizer=optimizer,
                      loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    recorder = _Recorder()
    callbacks = [tf_lossscale.LossScaleMonitor(verbose=log_skips), recorder]
    if logdir is not None:
        callbacks.append(keras.callbacks.TensorBoard(
            str(logdir), update_freq=1, write_graph=False))
    # shuffle=False: the injected NaNs must stay on their steps (and Keras
    # ignores shuffle for a tf.data dataset anyway, with a warning).
    model.fit(training_dataset(features, labels, config["batch_size"], steps,
                               inject_every),
              epochs=1, steps_per_epoch=steps, shuffle=False, verbose=verbose,
              callbacks=callbacks)
    probabilities = model(features, training=False)
    return DemoResult(
        final_loss_scale=recorder.loss_scales[-1],
        skipped_steps=int(optimizer.skipped_steps),
        skipped_at=tuple(recorder.skipped_at),
        injected_at=(tuple(range(inject_every, steps + 1, inject_every))
                     if inject_every else ()),
        # Under a strategy this is a MirroredVariable, which int() refuses.
        applied_steps=int(optimizer.iterations.numpy()),
        weights_finite=all(np.isfinite(np.asarray(weight)).all()
                           for weight in model.weights),
        final_loss=float(np.mean(keras.losses.sparse_categorical_crossentropy(
            labels, probabilities))),
        loss_scales=tuple(recorder.loss_scales))


def run(config, steps=None, num_devices=1, inject_nonfinite_every=0,
        verbose=1, logdir=None, plot=None, log_skips=False):
    """Trains the demo model and returns a `DemoResult`.

    `config` is a config dict (see `config.SCHEMA`, `load_config`); the other
    arguments except `verbose` (Keras' `fit` verbosity) are the
    `config.OPTIONS`.
    `steps` counts optimizer steps, applied or skipped. Everything is checked
    before training starts.

    Raises:
      ConfigError: `config` or an option is invalid, or the batch does not
        split evenly over the devices.
      MissingExtraError: `logdir` or `plot` needs a package not installed.
    """
    options = {"steps": steps, "num_devices": num_devices,
               "inject_nonfinite_every": inject_nonfinite_every,
               "logdir": logdir, "plot": plot, "log_skips": log_skips}
    config_lib.check_options(options)
    if logdir is not None:
        require_extra("--logdir")
    if plot is not None:
        require_extra("--plot")
    configure_devices(num_devices)
    config = config_lib.validate_config(config)
    if config["batch_size"] % num_devices:
        raise config_lib.ConfigError(
            f"config key 'batch_size' ({config['batch_size']}) must split "
            f"evenly over num_devices={num_devices}")
    result = _train(config, config["steps"] if steps is None else steps,
                    make_strategy(num_devices), inject_nonfinite_every,
                    verbose, logdir, log_skips)
    if plot is not None:
        plot_lib.plot_loss_scale(result, plot)
    return result

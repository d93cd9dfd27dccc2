"""Demo: float16 training with `tf_lossscale.LossScaleOptimizer`.

    python -m tf_lossscale.demo --steps=30 --num_devices=2 \\
        --inject_nonfinite_every=10

Trains a small classifier under the `mixed_float16` policy on a synthetic
dataset generated from the config's seed (nothing is downloaded), with Keras'
progress bar, and ends with one summary line, e.g.

    final loss scale: 4096.0, skipped steps: 3, weights finite: True

`--inject_nonfinite_every=N` puts a NaN into one example of every N-th batch.
The example is the batch's last one, which under `--num_devices` > 1 belongs
to the last replica: only that replica sees a non-finite gradient, and the
step is skipped only if all replicas agree to skip it. Each such step halves
a dynamic loss scale; with a fixed one (`configs/demo_fixed.json`) the NaN is
applied and the weights are lost.

The training config is a JSON object with exactly the keys of `CONFIG_KEYS`;
the default is the `configs/demo.json` shipped with the package. Its dynamic
loss scale starts at 2**15, and its data and model are small enough that no
step overflows float16 on its own (on its seed, none does over its 200 steps
even at 8 times that scale): every skipped step is an injected one, and the
summary's count is exact. The details line above it lists the skipped steps
and how many of them were not injected.

Keras' progress bar shows the running mean of the epoch's losses, which is
NaN from the first injected batch on; the final loss in the details line is
measured afterwards on the clean data.

The logic is importable: `run(load_config(), steps=30)` returns a `DemoResult`.
"""

import contextlib
import copy
import dataclasses
import importlib.resources
import json
import numbers
import pathlib
import sys

from absl import app
from absl import flags
from absl import logging
import keras
import numpy as np
import tensorflow as tf

import tf_lossscale

DEFAULT_CONFIG = "demo.json"

# What each config key holds; `validate_config` enforces it.
CONFIG_KEYS = {
    "loss_scale": "a tf_lossscale.get identifier: a number, 'dynamic' or "
                  "{'class_name': ..., 'config': {...}}",
    "optimizer": "the inner optimizer: a Keras optimizer name or "
                 "{'class_name': ..., 'config': {...}} without learning_rate",
    "learning_rate": "the inner optimizer's learning rate, a number > 0",
    "batch_size": "the global batch size, an int >= 1",
    "steps": "optimizer steps when --steps is not given, an int >= 1",
    "num_examples": "size of the synthetic dataset, an int >= 1",
    "input_dim": "features per example, an int >= 1",
    "hidden_units": "width of the hidden layer, an int >= 1",
    "num_classes": "number of classes, an int >= 2",
    "seed": "seed of the data and the initial weights, an int >= 0",
}

_INT_MINIMUMS = {
    "batch_size": 1,
    "steps": 1,
    "num_examples": 1,
    "input_dim": 1,
    "hidden_units": 1,
    "num_classes": 2,
    "seed": 0,
}


class ConfigError(ValueError):
    """A training config that cannot be used; the message names the key."""


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """What a demo run ended with.

    Attributes:
      final_loss_scale: the loss scale after the last step.
      skipped_steps: the optimizer's count of skipped steps.
      skipped_at: the 1-based steps whose gradients were skipped.
      injected_at: the 1-based steps given a NaN on purpose.
      applied_steps: steps whose gradients were applied.
      weights_finite: whether every model weight is finite at the end.
      final_loss: mean loss over the whole (clean) synthetic dataset.
    """

    final_loss_scale: float
    skipped_steps: int
    skipped_at: tuple
    injected_at: tuple
    applied_steps: int
    weights_finite: bool
    final_loss: float

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


# Loading and validating configs.


def default_config():
    """Returns the shipped demo.json as a readable resource.

    It comes from the installed package data (`tf_lossscale.configs`), or from
    the source tree's configs/ when the package is run from a checkout where
    that subpackage does not exist.
    """
    try:
        resource = importlib.resources.files("tf_lossscale.configs")
        resource = resource / DEFAULT_CONFIG
        if resource.is_file():
            return resource
    except ModuleNotFoundError:
        pass
    return pathlib.Path(__file__).resolve().parent.parent / (
        "configs/" + DEFAULT_CONFIG)


def load_config(path=None):
    """Reads a JSON training config; the shipped default when `path` is None.

    Only the JSON is read here; `validate_config` (which `run` calls) checks
    the contents.

    Raises:
      ConfigError: the file cannot be read or is not a JSON object.
    """
    source = default_config() if path is None else pathlib.Path(path)
    try:
        config = json.loads(source.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read config {source}: {err}") from err
    if not isinstance(config, dict):
        raise ConfigError(
            f"config {source} must be a JSON object, got "
            f"{type(config).__name__}")
    return config


def _check_keys(config):
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown config key {unknown[0]!r}; the keys are "
            f"{', '.join(CONFIG_KEYS)}")
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ConfigError(
            f"config key {missing[0]!r} is missing: {CONFIG_KEYS[missing[0]]}")


def _is_number(value):
    # JSON true/false arrive as bools, which Python counts as ints.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(key, value, minimum):
    if not _is_number(value) or not isinstance(value, numbers.Integral):
        raise ConfigError(
            f"config key {key!r} must be an int, got {value!r}")
    if value < minimum:
        raise ConfigError(
            f"config key {key!r} must be >= {minimum}, got {value!r}")


def _check_learning_rate(value):
    if not _is_number(value) or not 0 < value < float("inf"):
        raise ConfigError(
            f"config key 'learning_rate' must be a number > 0, got {value!r}")


def make_loss_scale(config):
    """Returns a new `tf_lossscale.LossScale` from `config["loss_scale"]`."""
    identifier = config["loss_scale"]
    if identifier is None:
        raise ConfigError("config key 'loss_scale' must not be null")
    try:
        return tf_lossscale.get(identifier)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config key 'loss_scale': {err}") from err


def make_inner_optimizer(config):
    """Returns a new Keras optimizer from `config["optimizer"]` and the rate.

    The learning rate comes only from `config["learning_rate"]`: a second one
    in the optimizer's own config would leave it unclear which one trains.
    """
    identifier = config["optimizer"]
    if not isinstance(identifier, (str, dict)):
        raise ConfigError(
            "config key 'optimizer' must be a Keras optimizer name or "
            f"config dict, got {identifier!r}")
    inner_config = (identifier.get("config")
                    if isinstance(identifier, dict) else None)
    if isinstance(inner_config, dict) and "learning_rate" in inner_config:
        raise ConfigError(
            "config key 'optimizer' sets learning_rate; set it once, in the "
            "config key 'learning_rate'")
    try:
        # Keras rewrites parts of a config dict it is given.
        optimizer = keras.optimizers.get(copy.deepcopy(identifier))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"config key 'optimizer': {err}") from err
    optimizer.learning_rate = config["learning_rate"]
    return optimizer


def validate_config(config):
    """Checks a training config and returns it unchanged.

    Besides keys, types and ranges, the loss scale and the optimizer are
    built once to prove they can be; this creates TensorFlow variables, so
    under `--num_devices` > 1 it must follow `configure_devices`.

    Raises:
      ConfigError: a key is unknown or missing or holds an unusable value;
        the message names that key.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"config must be a dict, got {config!r}")
    _check_keys(config)
    for key, minimum in _INT_MINIMUMS.items():
        _check_int(key, config[key], minimum)
    _check_learning_rate(config["learning_rate"])
    make_loss_scale(config)
    make_inner_optimizer(config)
    return config


# Devices and data.


def configure_devices(num_devices):
    """Makes sure TensorFlow has at least `num_devices` logical CPU devices.

    The split must happen before TensorFlow initialises its devices; a
    process that already has enough (e.g. split by its caller) is left as is.

    Raises:
      RuntimeError: the devices are initialised and too few.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if (len(configured) if configured else 1) >= num_devices:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    except RuntimeError as err:
        raise RuntimeError(
            f"num_devices={num_devices} needs that many logical CPU devices, "
            "but TensorFlow initialised its devices before they could be "
            "split; call configure_devices first") from err


def make_strategy(num_devices):
    """MirroredStrategy over the first `num_devices` CPUs; None for one.

    Logical CPUs share one host, so gradients are reduced through one device.
    That also lets `run` be called again in the same process: TensorFlow
    numbers the collective ops of every new strategy from the same keys, and
    strategies whose all-reduces differ would abort each other.
    """
    if num_devices == 1:
        return None
    return tf.distribute.MirroredStrategy(
        [f"/cpu:{index}" for index in range(num_devices)],
        cross_device_ops=tf.distribute.ReductionToOneDevice())


def synthetic_data(config):
    """Returns `(features, labels)` drawn from `config["seed"]`.

    Features are standard normal; each label is the argmax of a random linear
    teacher, so the classes are learnable.
    """
    rng = np.random.default_rng(config["seed"])
    features = rng.standard_normal(
        (config["num_examples"], config["input_dim"])).astype(np.float32)
    teacher = rng.standard_normal((config["input_dim"], config["num_classes"]))
    labels = np.argmax(features @ teacher, axis=1).astype(np.int32)
    return features, labels


def is_injected(step, inject_nonfinite_every):
    """Whether 1-based `step` gets a NaN (every N-th; never for N = 0)."""
    return inject_nonfinite_every > 0 and step % inject_nonfinite_every == 0


def training_dataset(features, labels, batch_size, steps,
                     inject_nonfinite_every=0):
    """Exactly `steps` batches, cycling through the examples in order.

    In every batch `k` (1-based) with `is_injected(k, ...)`, the first feature
    of the batch's last example is NaN. A distributed dataset hands out a
    batch in consecutive slices, so that example goes to the last replica.
    """
    features = tf.constant(features)
    labels = tf.constant(labels)
    num_examples = features.shape[0]
    nan_in_first_feature = tf.one_hot(
        0, features.shape[1], on_value=float("nan"), off_value=0.0)

    def example(index):
        x = tf.gather(features, index % num_examples)
        if inject_nonfinite_every:
            step = index // batch_size + 1
            poisoned = tf.logical_and(
                index % batch_size == batch_size - 1,
                step % inject_nonfinite_every == 0)
            x = tf.where(poisoned, x + nan_in_first_feature, x)
        return x, tf.gather(labels, index % num_examples)

    return (tf.data.Dataset.range(steps * batch_size)
            .map(example)
            .batch(batch_size, drop_remainder=True)
            .prefetch(tf.data.AUTOTUNE))


# The model and the training run.


def build_model(config):
    """A one-hidden-layer classifier in the current dtype policy."""
    seed = config["seed"]
    inputs = keras.Input((config["input_dim"],))
    hidden = keras.layers.Dense(
        config["hidden_units"], activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed))(inputs)
    logits = keras.layers.Dense(
        config["num_classes"],
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1))(
            hidden)
    # float16 probabilities round small ones to 0, and the loss takes logs.
    probabilities = keras.layers.Activation("softmax", dtype="float32")(logits)
    return keras.Model(inputs, probabilities)


@contextlib.contextmanager
def _global_policy(name):
    # The policy is process-wide; callers of `run` get theirs back.
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _mean_loss(model, features, labels):
    probabilities = model(features, training=False)
    return float(np.mean(keras.losses.sparse_categorical_crossentropy(
        labels, probabilities)))


def _all_finite(variables):
    return all(np.isfinite(np.asarray(v)).all() for v in variables)


class _SkipRecorder(keras.callbacks.Callback):
    """Notes the 1-based steps after which the optimizer's skip count grew."""

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer
        self._count = 0
        self.skipped_at = []

    def on_train_batch_end(self, batch, logs=None):
        count = int(self._optimizer.skipped_steps)
        if count > self._count:
            self.skipped_at.append(batch + 1)
        self._count = count


def _train(config, steps, strategy, inject_nonfinite_every, verbose):
    features, labels = synthetic_data(config)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with _global_policy("mixed_float16"), scope:
        model = build_model(config)
        optimizer = tf_lossscale.LossScaleOptimizer(
            make_inner_optimizer(config), loss_scale=make_loss_scale(config))
        model.compile(optimizer=optimizer,
                      loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    dataset = training_dataset(features, labels, config["batch_size"], steps,
                               inject_nonfinite_every)
    recorder = _SkipRecorder(optimizer)
    # shuffle=False: the injected NaNs must stay on their steps (and Keras
    # ignores shuffle for a tf.data dataset anyway, with a warning).
    model.fit(dataset, epochs=1, steps_per_epoch=steps, shuffle=False,
              verbose=verbose, callbacks=[recorder])
    return DemoResult(
        final_loss_scale=float(optimizer.loss_scale()),
        skipped_steps=int(optimizer.skipped_steps),
        skipped_at=tuple(recorder.skipped_at),
        injected_at=tuple(step for step in range(1, steps + 1)
                          if is_injected(step, inject_nonfinite_every)),
        # Under a strategy this is a MirroredVariable, which int() refuses.
        applied_steps=int(optimizer.iterations.numpy()),
        weights_finite=_all_finite(model.weights),
        final_loss=_mean_loss(model, features, labels))


def run(config, steps=None, num_devices=1, inject_nonfinite_every=0,
        verbose=1):
    """Trains the demo model and returns a `DemoResult`.

    Args:
      config: a training config dict (see `CONFIG_KEYS`, `load_config`).
      steps: optimizer steps (`apply_gradients` calls); None for the
        config's `steps`.
      num_devices: replicas of a MirroredStrategy over logical CPU devices;
        1 trains without a strategy.
      inject_nonfinite_every: 0 for clean data, else N: every N-th batch gets
        one NaN (see `training_dataset`).
      verbose: Keras' `fit` verbosity (1: progress bar, 0: silent).

    Raises:
      ConfigError: `config` is invalid, or its batch does not split evenly
        over the devices.
      ValueError: an argument is out of range.
    """
    if steps is not None:
        _check_count("steps", steps, 1)
    _check_count("num_devices", num_devices, 1)
    _check_count("inject_nonfinite_every", inject_nonfinite_every, 0)
    configure_devices(num_devices)
    validate_config(config)
    if config["batch_size"] % num_devices:
        raise ConfigError(
            f"config key 'batch_size' ({config['batch_size']}) must split "
            f"evenly over num_devices={num_devices}")
    return _train(config, config["steps"] if steps is None else steps,
                  make_strategy(num_devices), inject_nonfinite_every, verbose)


def _check_count(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or (
            value < minimum):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


# The command line.

flags.DEFINE_string(
    "config", None,
    "Path to a JSON training config; default: the shipped configs/demo.json.")
flags.DEFINE_integer(
    "steps", None, "Optimizer steps to train; default: the config's steps.",
    lower_bound=1)
flags.DEFINE_integer(
    "num_devices", 1,
    "Replicas of a MirroredStrategy over logical CPU devices; 1: no strategy.",
    lower_bound=1)
flags.DEFINE_integer(
    "inject_nonfinite_every", 0,
    "Put a NaN in every N-th batch (in the last replica's part); 0: never.",
    lower_bound=0)

FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS["verbosity"].present:
        # absl logs INFO by default, and tf.distribute's INFO lines would
        # bury the progress bar.
        logging.set_verbosity(logging.WARNING)
    try:
        result = run(load_config(FLAGS.config), steps=FLAGS.steps,
                     num_devices=FLAGS.num_devices,
                     inject_nonfinite_every=FLAGS.inject_nonfinite_every)
    except ConfigError as err:
        sys.exit(f"error: {err}")
    print(result.details())
    print(result.summary())


if __name__ == "__main__":
    app.run(main)

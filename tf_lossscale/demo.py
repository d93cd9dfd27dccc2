"""Demo: a float16 run with `tf_lossscale`, and what its loss scale does.

    python -m tf_lossscale.demo --num_devices=2 [--plot=docs/loss_scale.png]
        [--logdir=runs/demo] [--log_skips] [--inject_nonfinite_every=N]

Trains a small classifier in `mixed_float16` on synthetic data drawn from the
config's seed. The default dynamic loss scale starts at 2**24, far above what
the float16 gradients can take: the first steps overflow and are skipped
while the scale halves (calibration). Then the scale doubles after every 20
finite steps, and when that makes a batch's float16 gradients overflow, the
step is skipped and the scale halves again. The float32 loss stays finite.

`LossScaleMonitor` shows `loss_scale` and `skipped_steps` in the progress bar;
`--logdir` adds Keras' TensorBoard callback after it, `--plot` writes a PNG
of the scale over the steps (extras "tensorboard" and "plot": without them
the demo stops before training and says what to install).
`--inject_nonfinite_every=N` puts a NaN into the last example of every N-th
batch, which under `--num_devices` > 1 only the last replica sees. The
output ends with the summary line, e.g.

    final loss scale: 524288.0, skipped steps: 12, weights finite: True

A config is a JSON object with keys of `SCHEMA`, which gives the defaults of
missing keys (`configs/demo.json` spells them out). `run(load_config())`
returns a `DemoResult`.
"""

import contextlib
import copy
import dataclasses
import importlib
import json
import math
import pathlib
import sys
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging
import keras
import numpy as np
import tensorflow as tf

import tf_lossscale
from tf_lossscale import monitor


class ConfigError(ValueError):
    """A config value or an option that cannot be used; names the key."""


class MissingExtraError(ImportError):
    """An optional package a flag needs is not installed."""


# The config schema.


@dataclasses.dataclass(frozen=True)
class Field:
    """One config key: what its value must be (`kind`, for the error
    message), its `default`, and `check`, which returns whether a value is
    usable or raises TypeError/ValueError saying why not."""

    kind: str
    default: Any
    check: Callable[[Any], Any]


def _check(name, field, value):
    """The one validation routine, for config keys and options alike."""
    try:
        usable, reason = field.check(value), ""
    except (TypeError, ValueError) as err:
        usable, reason = False, f": {err}"
    if not usable:
        raise ConfigError(f"{name} must be {field.kind}, got {value!r}{reason}")


def _is_int(value):
    # JSON true/false arrive as bools, which Python counts as ints.
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(default, minimum, meaning, optional=False):
    return Field(f"an int >= {minimum} ({meaning})", default,
                 lambda value: (optional and value is None) or (
                     _is_int(value) and value >= minimum))


def _path_field(meaning, suffix=""):
    return Field(f"a path{suffix and ' ending in ' + suffix} ({meaning})",
                 None, lambda value: value is None or (
                     isinstance(value, (str, pathlib.PurePath)) and
                     str(value).lower().endswith(suffix)))


def _loss_scale(identifier):
    if identifier is None:
        raise ValueError("null is not a loss scale")
    return tf_lossscale.get(identifier)


def _inner_optimizer(identifier):
    if not isinstance(identifier, (str, dict)):
        raise TypeError(f"{type(identifier).__name__} is not an optimizer")
    inner_config = (identifier.get("config")
                    if isinstance(identifier, dict) else None)
    # A second learning rate would leave it unclear which one trains.
    if isinstance(inner_config, dict) and "learning_rate" in inner_config:
        raise ValueError(
            "it sets learning_rate; set it once, in the config key "
            "'learning_rate'")
    # Keras rewrites parts of a config dict it is given.
    return keras.optimizers.get(copy.deepcopy(identifier))


SCHEMA = {
    "loss_scale": Field(
        "a tf_lossscale.get identifier: a number, 'dynamic' or "
        "{'class_name': ..., 'config': {...}}",
        {"class_name": "DynamicLossScale",
         "config": {"initial_loss_scale": 2.0**24, "increment_period": 20,
                    "multiplier": 2.0}},
        _loss_scale),
    "optimizer": Field(
        "a Keras optimizer name or {'class_name': ..., 'config': {...}} "
        "without learning_rate",
        {"class_name": "Adam", "config": {}},
        _inner_optimizer),
    "learning_rate": Field(
        "a number > 0", 0.01, lambda value: (_is_int(value) or isinstance(
            value, float)) and 0 < value < math.inf),
    "batch_size": _int_field(64, 1, "the global batch size"),
    "steps": _int_field(200, 1, "optimizer steps when --steps is not given"),
    "num_examples": _int_field(2048, 1, "size of the synthetic dataset"),
    "input_dim": _int_field(16, 1, "features per example"),
    "hidden_units": _int_field(32, 1, "width of the hidden layer"),
    "num_classes": _int_field(4, 2, "number of classes"),
    "seed": _int_field(1, 0, "seed of the data and the initial weights"),
}


# The options of `run` and the command line: name -> (flag definer, Field).
OPTIONS = {
    "steps": (flags.DEFINE_integer, _int_field(
        None, 1, "optimizer steps to train; default: the config's",
        optional=True)),
    "num_devices": (flags.DEFINE_integer, _int_field(
        1, 1, "replicas of a MirroredStrategy over logical CPU devices; "
        "1: no strategy")),
    "inject_nonfinite_every": (flags.DEFINE_integer, _int_field(
        0, 0, "put a NaN into every N-th batch, in the last replica's part; "
        "0: never")),
    "logdir": (flags.DEFINE_string, _path_field(
        "where to write TensorBoard event files; needs the tensorboard "
        "extra")),
    "plot": (flags.DEFINE_string, _path_field(
        "where to write a plot of the loss scale; needs the plot extra",
        ".png")),
    "log_skips": (flags.DEFINE_bool, Field(
        "a bool (print skipped steps as they happen, rate-limited, with the "
        "variables whose gradients overflowed)", False,
        lambda value: isinstance(value, bool))),
}


def default_config():
    """A new config dict holding every key's default."""
    return {key: copy.deepcopy(field.default) for key, field in SCHEMA.items()}


def load_config(path=None):
    """Reads a JSON config (not yet validated); the defaults for None.

    Raises ConfigError if the file cannot be read or is not a JSON object.
    """
    if path is None:
        return default_config()
    try:
        config = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read config {path}: {err}") from err
    if not isinstance(config, dict):
        raise ConfigError(
            f"config {path} must be a JSON object, got {type(config).__name__}")
    return config


def validate_config(config):
    """Checks a config against `SCHEMA`; returns a copy with the defaults
    filled in. Raises ConfigError naming an unknown key or a bad value.

    Building the loss scale and the optimizer to check them creates
    variables, so under `--num_devices` > 1 call `configure_devices` first.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"config must be a dict, got {config!r}")
    unknown = sorted(set(config) - set(SCHEMA))
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}; the keys are "
                          f"{', '.join(SCHEMA)}")
    completed = default_config()
    completed.update(config)
    for key, field in SCHEMA.items():
        _check(f"config key {key!r}", field, completed[key])
    return completed


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
    in one process with another device count (tests/strategies.py says why).
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
        inner = _inner_optimizer(config["optimizer"])
        inner.learning_rate = config["learning_rate"]
        optimizer = tf_lossscale.LossScaleOptimizer(
            inner, loss_scale=_loss_scale(config["loss_scale"]))
        model.compile(optimizer=optimizer,
                      loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    recorder = _Recorder()
    callbacks = [monitor.LossScaleMonitor(verbose=log_skips), recorder]
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


def plot_loss_scale(result, path):
    """Writes a PNG of the loss scale over the steps, skipped steps marked.

    Needs matplotlib (the "plot" extra); uses its Agg backend, not pyplot.
    """
    # pylint: disable=g-import-not-at-top
    from matplotlib.backends import backend_agg
    from matplotlib import figure
    # Step k ran with the scale before it, loss_scales[k - 1].
    steps = np.arange(1, len(result.loss_scales))
    used = np.asarray(result.loss_scales[:-1])
    skipped = np.asarray(result.skipped_at, dtype=int)
    fig = figure.Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    backend_agg.FigureCanvasAgg(fig)
    axes = fig.add_subplot()
    # Calibration: the skips that run without a break from step 1.
    calibration = next((i for i, step in enumerate(result.skipped_at)
                        if step != i + 1), len(result.skipped_at))
    if calibration:
        axes.axvspan(0.5, calibration + 0.5, color="tab:orange", alpha=0.15,
                     label=f"calibration (steps 1-{calibration})")
    axes.step(steps, used, where="post", color="tab:blue",
              label="loss scale the step ran with")
    axes.plot(skipped, used[skipped - 1], "v", color="tab:red",
              label=f"skipped step, scale halved ({len(skipped)})")
    axes.set_yscale("log", base=2)
    axes.set(xlim=(0, len(steps) + 1), ylabel="loss scale (log2 axis)",
             xlabel="optimizer step (applied or skipped)")
    axes.set_title(f"{len(steps)} float16 steps: {result.applied_steps} "
                   f"applied, {result.skipped_steps} skipped")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="upper right")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def run(config, steps=None, num_devices=1, inject_nonfinite_every=0,
        verbose=1, logdir=None, plot=None, log_skips=False):
    """Trains the demo model and returns a `DemoResult`.

    `config` is a config dict (see `SCHEMA`, `load_config`); the other
    arguments except `verbose` (Keras' `fit` verbosity) are the `OPTIONS`.
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
    for name, value in options.items():
        _check(f"--{name}", OPTIONS[name][1], value)
    if logdir is not None:
        require_extra("--logdir")
    if plot is not None:
        require_extra("--plot")
    configure_devices(num_devices)
    config = validate_config(config)
    if config["batch_size"] % num_devices:
        raise ConfigError(
            f"config key 'batch_size' ({config['batch_size']}) must split "
            f"evenly over num_devices={num_devices}")
    result = _train(config, config["steps"] if steps is None else steps,
                    make_strategy(num_devices), inject_nonfinite_every,
                    verbose, logdir, log_skips)
    if plot is not None:
        plot_loss_scale(result, plot)
    return result


# The command line.

flags.DEFINE_string(
    "config", None, "Path to a JSON training config; keys it leaves out take "
    "their defaults (configs/demo.json lists them).")
for _name, (_define, _field) in OPTIONS.items():
    _define(_name, _field.default, _field.kind)

FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS["verbosity"].present:
        # absl logs INFO by default, and tf.distribute's INFO lines would
        # bury the progress bar.
        logging.set_verbosity(logging.WARNING)
    try:
        result = run(load_config(FLAGS.config),
                     **{name: FLAGS[name].value for name in OPTIONS})
    except (ConfigError, MissingExtraError) as err:
        sys.exit(f"error: {err}")
    if FLAGS.plot:
        print(f"loss scale plot: {FLAGS.plot}")
    if FLAGS.logdir:
        print(f"TensorBoard logs: tensorboard --logdir={FLAGS.logdir}")
    print(result.details())
    print(result.summary())


if __name__ == "__main__":
    app.run(main)

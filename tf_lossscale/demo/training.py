"""The demo's training run: devices, synthetic data, the model, `run`, and
the plot of its loss scale."""

import dataclasses
import importlib
import pathlib

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale
from tf_lossscale.demo import config as config_lib


class MissingExtraError(ImportError):
    """An optional package an option needs is not installed."""


def configure_devices(num_devices):
    """Splits the CPU into `num_devices` logical devices unless it has enough
    (only before TensorFlow initialises its devices)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or [cpu]) < (
            num_devices):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)


def make_strategy(num_devices):
    """MirroredStrategy over the first `num_devices` CPUs; the default
    strategy for one."""
    if num_devices == 1:
        return tf.distribute.get_strategy()
    # Reduced through one device: a process can run several device counts.
    return tf.distribute.MirroredStrategy(
        [f"/cpu:{index}" for index in range(num_devices)],
        cross_device_ops=tf.distribute.ReductionToOneDevice())


def synthetic_data(config):
    """`(features, labels)` from `config.seed`: standard normal features,
    labels from a random linear teacher, so the classes are learnable."""
    rng = np.random.default_rng(config.seed)
    features = rng.standard_normal(
        (config.num_examples, config.input_dim)).astype(np.float32)
    teacher = rng.standard_normal((config.input_dim, config.num_classes))
    labels = np.argmax(features @ teacher, axis=1).astype(np.int32)
    return features, labels


def training_dataset(features, labels, batch_size, steps,
                     inject_nonfinite_every=0):
    """Exactly `steps` batches, cycling through the examples in order; with
    `inject_nonfinite_every=N` > 0 every N-th batch's last example (the last
    replica's) has a NaN."""
    dataset = (tf.data.Dataset.from_tensor_slices((features, labels))
               .repeat().batch(batch_size, drop_remainder=True).take(steps))
    if inject_nonfinite_every:
        nan = np.zeros((batch_size, features.shape[1]), np.float32)
        nan[-1, 0] = np.nan
        dataset = dataset.enumerate(start=1).map(lambda step, batch: (
            tf.where(step % inject_nonfinite_every == 0, batch[0] + nan,
                     batch[0]), batch[1]))
    return dataset.prefetch(tf.data.AUTOTUNE)


def build_model(config):
    """A one-hidden-layer classifier computing in float16 (`mixed_float16`:
    float32 weights); the process-wide dtype policy is left alone."""
    outputs = inputs = keras.Input((config.input_dim,))
    for seed, (units, activation) in enumerate(
            [(config.hidden_units, "relu"), (config.num_classes, None)]):
        outputs = keras.layers.Dense(
            units, activation, dtype="mixed_float16",
            kernel_initializer=keras.initializers.GlorotUniform(
                seed=config.seed + seed))(outputs)
    # float16 probabilities round small ones to 0, and the loss takes logs.
    return keras.Model(inputs, keras.layers.Activation(
        "softmax", dtype="float32")(outputs))


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

    def summary(self):
        """The demo's last output line."""
        return (f"final loss scale: {self.final_loss_scale}, "
                f"skipped steps: {self.skipped_steps}, "
                f"weights finite: {self.weights_finite}")

    def details(self):
        """A line with the counts behind the summary and the final loss."""
        organic = len(set(self.skipped_at) - set(self.injected_at))
        return (f"applied steps: {self.applied_steps}, "
                f"injected non-finite steps: {len(self.injected_at)}, "
                f"skipped at steps: {list(self.skipped_at)} "
                f"({organic} not injected), "
                f"final loss: {self.final_loss:.4f}")


def run(config, steps=None, num_devices=1, inject_nonfinite_every=0,
        logdir=None, plot=None, log_skips=False, verbose=1):
    """Trains the demo model as `config` and the options (the flags) say;
    returns a `DemoResult`.

    Raises (before training):
      ConfigError: `config` is no `Config`, an option is bad, or the batch
        does not split evenly over the devices.
      MissingExtraError: `logdir` or `plot` needs a package not installed.
    """
    config_lib.check("config", config, "a tf_lossscale.demo.Config",
                     lambda value: isinstance(value, config_lib.Config))
    options = locals()  # The arguments, before the body adds names.
    for name, (kind, is_usable) in config_lib.OPTIONS.items():
        config_lib.check(name, options[name], kind, is_usable)
    for option, package, extra in (("logdir", "tensorboard", "tensorboard"),
                                   ("plot", "matplotlib", "plot")):
        try:
            if options[option] is not None:
                importlib.import_module(package)
        except ImportError as err:
            raise MissingExtraError(
                f"--{option} needs {package}, which is not installed: "
                f'pip install "tf_lossscale[{extra}]" (in a source checkout: '
                f'pip install -e ".[{extra}]")') from err
    configure_devices(num_devices)
    config_lib.check("config key 'batch_size'", config.batch_size,
                     f"a multiple of num_devices={num_devices}",
                     lambda value: value % num_devices == 0)
    steps = config.steps if steps is None else steps
    features, labels = synthetic_data(config)
    strategy = make_strategy(num_devices)
    with strategy.scope():
        model = build_model(config)
        inner = config_lib.inner_optimizer(config.optimizer)
        inner.learning_rate = config.learning_rate
        optimizer = tf_lossscale.LossScaleOptimizer(
            inner, loss_scale=tf_lossscale.get(config.loss_scale))
        model.compile(optimizer, loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    logged = [(float(optimizer.loss_scale()), int(optimizer.skipped_steps))]
    callbacks = [
        tf_lossscale.LossScaleMonitor(verbose=log_skips),
        keras.callbacks.LambdaCallback(on_train_batch_end=lambda _, logs: (
            logged.append((logs["loss_scale"], logs["skipped_steps"]))))]
    if logdir is not None:
        callbacks.append(keras.callbacks.TensorBoard(
            str(logdir), update_freq=1, write_graph=False))
    # shuffle=False: the injected NaNs must stay on their steps (and Keras
    # ignores shuffle for a tf.data dataset anyway, with a warning).
    model.fit(training_dataset(features, labels, config.batch_size, steps,
                               inject_nonfinite_every),
              epochs=1, steps_per_epoch=steps, shuffle=False, verbose=verbose,
              callbacks=callbacks)
    scales, counts = zip(*logged)
    every = inject_nonfinite_every
    result = DemoResult(
        final_loss_scale=scales[-1],
        skipped_steps=int(optimizer.skipped_steps),
        skipped_at=tuple(step for step in range(1, len(counts))
                         if counts[step] > counts[step - 1]),
        injected_at=tuple(range(every, steps + 1, every)) if every else (),
        # Under a strategy this is a MirroredVariable, which int() refuses.
        applied_steps=int(optimizer.iterations.numpy()),
        weights_finite=all(np.isfinite(np.asarray(weight)).all()
                           for weight in model.weights),
        final_loss=float(np.mean(keras.losses.sparse_categorical_crossentropy(
            labels, model(features, training=False)))),
        loss_scales=scales)
    if plot is not None:
        plot_loss_scale(result, plot)
    return result


def plot_loss_scale(result, path):
    """Writes a PNG of `result`'s loss scale over the steps to `path`."""
    # pylint: disable=g-import-not-at-top
    from matplotlib import figure  # Not pyplot: no global figure state.
    # Step k ran with the scale before it, loss_scales[k - 1].
    steps = np.arange(1, len(result.loss_scales))
    used = np.asarray(result.loss_scales[:-1])
    skipped = np.asarray(result.skipped_at, dtype=int)
    fig = figure.Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
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
             xlabel="optimizer step (applied or skipped)",
             title=f"{len(steps)} float16 steps: {result.applied_steps} "
             f"applied, {result.skipped_steps} skipped")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="upper right")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")

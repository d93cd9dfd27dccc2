"""`python -m tf_lossscale.demo`: the demo's command line (its flags are
registered when it runs, not on import)."""

import sys

from absl import app
from absl import flags
from absl import logging

from tf_lossscale.demo import config as config_lib
from tf_lossscale.demo import training


def define_flags(values=flags.FLAGS):
    """Registers the demo's flags in `values` (absl's `FlagValues`)."""
    for define, name, default, help_text in (
            (flags.DEFINE_string, "config", None, "path to a JSON training "
             "config; keys it leaves out take their defaults "
             "(configs/demo.json lists them)"),
            (flags.DEFINE_integer, "steps", None, "optimizer steps to train, "
             "applied or skipped; default: the config's"),
            (flags.DEFINE_integer, "num_devices", 1, "replicas of a "
             "MirroredStrategy over logical CPU devices; 1: no strategy"),
            (flags.DEFINE_integer, "inject_nonfinite_every", 0, "put a NaN "
             "into every N-th batch, in the last replica's part; 0: never"),
            (flags.DEFINE_string, "logdir", None, "where to write TensorBoard "
             "event files; needs the tensorboard extra"),
            (flags.DEFINE_string, "plot", None, "where to write a PNG plot of "
             "the loss scale; needs the plot extra"),
            (flags.DEFINE_bool, "log_skips", False, "print skipped steps as "
             "they happen, rate-limited, with the variables whose gradients "
             "overflowed")):
        define(name, default, help_text, flag_values=values)
    for name, (kind, usable) in config_lib.OPTIONS.items():
        flags.register_validator(name, usable, f"must be {kind}",
                                 flag_values=values)


def _run(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    values = flags.FLAGS
    if not values["verbosity"].present:
        # tf.distribute's INFO lines would bury the progress bar.
        logging.set_verbosity(logging.WARNING)
    try:
        # Before the config builds its loss scale and optimizer.
        training.configure_devices(values.num_devices)
        result = training.run(config_lib.Config.load(values.config), **{
            name: values[name].value for name in config_lib.OPTIONS})
    except (config_lib.ConfigError, training.MissingExtraError) as err:
        sys.exit(f"error: {err}")
    if values.plot:
        print(f"loss scale plot: {values.plot}")
    if values.logdir:
        print(f"TensorBoard logs: tensorboard --logdir={values.logdir}")
    print(result.details(), result.summary(), sep="\n")


if __name__ == "__main__":
    define_flags()
    app.run(_run)

"""`python -m tf_lossscale.demo`: the demo's command line.

The flags are the options of `training.run` (`config.OPTIONS`) plus
`--config`, a path to a JSON config. They are registered when the command
runs, not when the demo package is imported, so importing it leaves absl's
global flags alone.
"""

import sys

from absl import app
from absl import flags
from absl import logging

from tf_lossscale.demo import config as config_lib
from tf_lossscale.demo import training

_DEFINE = {"integer": flags.DEFINE_integer, "string": flags.DEFINE_string,
           "bool": flags.DEFINE_bool}


def _define_flags():
    flags.DEFINE_string(
        "config", None, "Path to a JSON training config; keys it leaves out "
        "take their defaults (configs/demo.json lists them).")
    for name, option in config_lib.OPTIONS.items():
        _DEFINE[option.flag_type](name, option.field.default,
                                  option.field.kind)


def _run(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    values = flags.FLAGS
    if not values["verbosity"].present:
        # absl logs INFO by default, and tf.distribute's INFO lines would
        # bury the progress bar.
        logging.set_verbosity(logging.WARNING)
    try:
        result = training.run(
            config_lib.load_config(values.config),
            **{name: values[name].value for name in config_lib.OPTIONS})
    except (config_lib.ConfigError, training.MissingExtraError) as err:
        sys.exit(f"error: {err}")
    if values.plot:
        print(f"loss scale plot: {values.plot}")
    if values.logdir:
        print(f"TensorBoard logs: tensorboard --logdir={values.logdir}")
    print(result.details())
    print(result.summary())


def main():
    """Registers the flags, parses the command line and runs the demo."""
    _define_flags()
    app.run(_run)


if __name__ == "__main__":
    main()

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

The parts: `config` (the config schema and the options), `training` (data,
model, `run`), `plot` (the PNG), `__main__` (the command line). The names
below are the ones a program uses: `run(load_config())` returns a
`DemoResult`.
"""

from tf_lossscale.demo.config import ConfigError
from tf_lossscale.demo.config import default_config
from tf_lossscale.demo.config import load_config
from tf_lossscale.demo.config import OPTIONS
from tf_lossscale.demo.config import SCHEMA
from tf_lossscale.demo.config import validate_config
from tf_lossscale.demo.plot import plot_loss_scale
from tf_lossscale.demo.training import build_model
from tf_lossscale.demo.training import configure_devices
from tf_lossscale.demo.training import DemoResult
from tf_lossscale.demo.training import make_strategy
from tf_lossscale.demo.training import MissingExtraError
from tf_lossscale.demo.training import require_extra
from tf_lossscale.demo.training import run
from tf_lossscale.demo.training import synthetic_data
from tf_lossscale.demo.training import training_dataset

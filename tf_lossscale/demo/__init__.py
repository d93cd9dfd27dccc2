"""Demo: a float16 run with `tf_lossscale`, and what its loss scale does.

`python -m tf_lossscale.demo` (the command line: `__main__`) trains a small
classifier in `mixed_float16` on synthetic data (`training.run`, configured
by `config.Config` and `config.Options`) and can plot its loss scale
(`plot`). The Monitoring guide, docs/guides/monitoring.md, says what it shows.
"""

from tf_lossscale.demo.config import Config
from tf_lossscale.demo.config import ConfigError
from tf_lossscale.demo.config import Options
from tf_lossscale.demo.plot import plot_loss_scale
from tf_lossscale.demo.training import DemoResult
from tf_lossscale.demo.training import MissingExtraError
from tf_lossscale.demo.training import build_model
from tf_lossscale.demo.training import configure_devices
from tf_lossscale.demo.training import make_strategy
from tf_lossscale.demo.training import run
from tf_lossscale.demo.training import synthetic_data
from tf_lossscale.demo.training import training_dataset

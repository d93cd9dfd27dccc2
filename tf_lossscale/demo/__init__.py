"""Demo: a float16 run with `tf_lossscale`, and what its loss scale does
(`python -m tf_lossscale.demo`; docs/guides/monitoring.md shows a run). The
README's figure: `python -m tf_lossscale.demo --num_devices=2
--plot=docs/loss_scale.png`."""

from tf_lossscale.demo.config import Config
from tf_lossscale.demo.config import ConfigError
from tf_lossscale.demo.training import MissingExtraError
from tf_lossscale.demo.training import build_model
from tf_lossscale.demo.training import run
from tf_lossscale.demo.training import synthetic_data
from tf_lossscale.demo.training import training_dataset

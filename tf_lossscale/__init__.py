"""tf_lossscale: loss scaling for float16 training with TensorFlow and Keras.

Public API:

* `LossScale`, `FixedLossScale`, `DynamicLossScale`: loss scales with the
  contract of TensorFlow's `tf.compat.v1.mixed_precision.LossScale`;
* `get`, `serialize`, `deserialize`: identifiers and configs to loss scales;
* `LossScaleOptimizer`: the Keras optimizer wrapper that uses them;
* `LossScaleMonitor`: a Keras callback that puts the current loss scale and
  the count of skipped steps into the logs of `fit` (progress bar, History,
  CSVLogger, TensorBoard).
"""

# TensorFlow is not a pip requirement of this package (setup.py says why):
# check here, before any module imports it, that one is installed and in the
# supported range, with an ImportError that says how to fix it.
from tf_lossscale import tensorflow_requirement as _tensorflow_requirement

_tensorflow_requirement.check_tensorflow()

# pylint: disable=g-import-not-at-top,wrong-import-position
from tf_lossscale.keras_optimizer import LossScaleOptimizer
from tf_lossscale.loss_scale import DynamicLossScale
from tf_lossscale.loss_scale import FixedLossScale
from tf_lossscale.loss_scale import LossScale
from tf_lossscale.monitor import LossScaleMonitor
from tf_lossscale.serialization import deserialize
from tf_lossscale.serialization import get
from tf_lossscale.serialization import serialize
# pylint: enable=g-import-not-at-top,wrong-import-position

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "deserialize",
    "get",
    "serialize",
]

"""tf_lossscale: loss scaling for float16 training with TensorFlow and Keras.

Public API (docs/reference says more of each):

* `LossScale`, `FixedLossScale`, `DynamicLossScale` (TensorFlow's contract);
  `get`, `serialize`, `deserialize`; `LossScaleGroup` (several optimizers);
* `LossScaleOptimizer` (Keras 3, and tf-keras optimizers' wrapper);
  `compat.v1.MixedPrecisionLossScaleOptimizer` (TF1 graphs and Sessions);
* `LossScaleMonitor`, `XlaChecks`, `with_xla_checks`: logs and host checks;
* `diagnose`, `Float16Diagnosis`: why float16 fails, layer by layer, and the
  fix; `layerwise.scale_per_layer`: a gradient scale per layer;
* `FailureWatch`, `FailureReport`, `Float16FailureError`: a failing run
  diagnosed where it fails, stopped or carried on (`tf_lossscale.watch`).
"""

# TensorFlow is no pip requirement (setup.py says why): before any module
# imports it, refuse a missing or too old TensorFlow or Keras.
from tf_lossscale._internal import versions as _versions

_newer_than_tested = [_versions.check(_versions.TENSORFLOW),
                      _versions.check(_versions.KERAS)]

# pylint: disable=g-import-not-at-top,wrong-import-position
from importlib import util as _importlib_util

from tf_lossscale.step import optimizer_protocol as _optimizer_protocol

# With `tf.keras` being tf-keras, the tf-keras wrappers are registered below
# for `load_model`; otherwise tf_keras is imported only when needed.
_tf_keras_now = _optimizer_protocol.tf_keras_is_tf_keras() and (
    _importlib_util.find_spec("tf_keras") is not None)
if _tf_keras_now:
    _newer_than_tested.append(_versions.check(_versions.TF_KERAS))
_versions.warn_untested(_newer_than_tested)

from tf_lossscale import compat
from tf_lossscale import layerwise
from tf_lossscale._internal.checks import DoubleScalingError
from tf_lossscale._internal.checks import ReplicaContextError
from tf_lossscale._internal.checks import SharedLossScaleWarning
from tf_lossscale._internal.versions import UntestedReleaseWarning
from tf_lossscale.diagnosis import Float16Diagnosis, diagnose
from tf_lossscale.keras3.loss_scale_optimizer import LossScaleOptimizer
from tf_lossscale.loss_scales import DynamicLossScale
from tf_lossscale.loss_scales import FixedLossScale
from tf_lossscale.loss_scales import LossScale
from tf_lossscale.groups import LossScaleGroup
from tf_lossscale.loss_scales import deserialize
from tf_lossscale.loss_scales import get
from tf_lossscale.loss_scales import serialize
from tf_lossscale.loss_scales import with_xla_checks
from tf_lossscale.monitor import LossScaleMonitor, XlaChecks
from tf_lossscale import watch
from tf_lossscale.watch import FailureReport, FailureWatch
from tf_lossscale.watch import Float16FailureError

if _tf_keras_now:
    from tf_lossscale.tf_keras import loss_scale_optimizer as _tf_keras_wrappers  # pylint: disable=unused-import
# pylint: enable=g-import-not-at-top,wrong-import-position

__version__ = "0.6.0.dev0"

__all__ = [
    "DoubleScalingError", "DynamicLossScale", "FailureReport",
    "FailureWatch", "FixedLossScale", "Float16Diagnosis",
    "Float16FailureError", "LossScale", "LossScaleGroup", "LossScaleMonitor",
    "LossScaleOptimizer", "ReplicaContextError", "SharedLossScaleWarning",
    "UntestedReleaseWarning",
    "XlaChecks", "compat", "deserialize", "diagnose", "get", "layerwise",
    "serialize", "watch", "with_xla_checks"
]

"""Loss scales: the `LossScale` contract, `FixedLossScale`, `DynamicLossScale`."""

from tf_lossscale.loss_scales.dynamic_loss_scale import DynamicLossScale
from tf_lossscale.loss_scales.loss_scale import FixedLossScale
from tf_lossscale.loss_scales.loss_scale import LossScale
from tf_lossscale.loss_scales.serialization import deserialize
from tf_lossscale.loss_scales.serialization import get
from tf_lossscale.loss_scales.serialization import serialize
from tf_lossscale.loss_scales.xla_checks import with_xla_checks

"""Loss scales: the `LossScale` contract, `FixedLossScale`, `DynamicLossScale`
(`LossScaleGroup` is in `tf_lossscale.groups`)."""

from tf_lossscale.loss_scales.dynamic_loss_scale import DynamicLossScale
from tf_lossscale.loss_scales.loss_scale import FixedLossScale, LossScale
from tf_lossscale.loss_scales.serialization import deserialize, get, serialize
from tf_lossscale.loss_scales.xla_checks import with_xla_checks

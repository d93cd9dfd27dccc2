"""Deprecated path of 0.4: import these names from `tf_lossscale` instead.

Kept for 0.5 only; every name here is public at the package root, or in
`tf_lossscale.loss_scales`.
"""

import warnings

from tf_lossscale.loss_scales.dynamic_loss_scale import DynamicLossScale  # pylint: disable=unused-import
from tf_lossscale.loss_scales.dynamic_rule import DynamicRule  # pylint: disable=unused-import
from tf_lossscale.loss_scales.dynamic_rule import DynamicState  # pylint: disable=unused-import
from tf_lossscale.loss_scales.dynamic_rule import next_dynamic_state  # pylint: disable=unused-import
from tf_lossscale.loss_scales.failure_policy import POLICIES  # pylint: disable=unused-import
from tf_lossscale.loss_scales.failure_policy import WARNING_PREFIX  # pylint: disable=unused-import
from tf_lossscale.loss_scales.loss_scale import FixedLossScale  # pylint: disable=unused-import
from tf_lossscale.loss_scales.loss_scale import LossScale  # pylint: disable=unused-import

warnings.warn(
    "tf_lossscale.loss_scale is deprecated and goes in 0.6: import "
    "LossScale, FixedLossScale and DynamicLossScale from tf_lossscale",
    DeprecationWarning, stacklevel=2)

"""Deprecated path of 0.4: the tf-keras wrapper classes.

`tf_lossscale.LossScaleOptimizer(tf_keras_optimizer)` returns them; their
module is now `tf_lossscale.tf_keras.loss_scale_optimizer`. Kept for 0.5 only.
"""

import warnings

from tf_lossscale.tf_keras.loss_scale_optimizer import LegacyLossScaleOptimizer  # pylint: disable=unused-import
from tf_lossscale.tf_keras.loss_scale_optimizer import LossScaleOptimizer  # pylint: disable=unused-import
from tf_lossscale.tf_keras.loss_scale_optimizer import WRAPPER_CLASSES  # pylint: disable=unused-import
from tf_lossscale.tf_keras.loss_scale_optimizer import wrap  # pylint: disable=unused-import

warnings.warn(
    "tf_lossscale.tf_keras_optimizer is deprecated and goes in 0.6: "
    "tf_lossscale.LossScaleOptimizer(optimizer) gives the tf-keras wrapper; "
    "the classes are in tf_lossscale.tf_keras.loss_scale_optimizer",
    DeprecationWarning, stacklevel=2)

"""The TF1 optimizer wrapper: `MixedPrecisionLossScaleOptimizer`, driven by
any `tf_lossscale` loss scale (see `tf_lossscale.tf1_optimizer`)."""

from tf_lossscale.tf1_optimizer import MixedPrecisionLossScaleOptimizer

__all__ = ["MixedPrecisionLossScaleOptimizer"]

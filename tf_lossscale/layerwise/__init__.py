"""Per-layer gradient scaling: `scale_per_layer`, and the `LayerwiseModel`
and `GradientScaling` layers it builds (docs/guides/per-layer-scaling.md)."""

from tf_lossscale.layerwise.boundary import GradientScaling
from tf_lossscale.layerwise.model import LayerwiseModel
from tf_lossscale.layerwise.transform import scale_per_layer

__all__ = ["GradientScaling", "LayerwiseModel", "scale_per_layer"]

"""Drop-in replacements under TensorFlow's `tf.compat` names.

`tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer` stands where
`tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer` stood.
"""

from tf_lossscale.compat import v1

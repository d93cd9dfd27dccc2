"""Tests of the Keras callbacks `LossScaleMonitor` and its gradient
statistics, and of `tf_lossscale.ops.float16`."""

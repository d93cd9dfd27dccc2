"""Tests of the Keras 3 `LossScaleOptimizer`: API, fit, drop-in for Keras'
wrapper, what the wrappers share, float8, multi-worker."""

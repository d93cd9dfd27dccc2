"""Tests of the loss scales: FixedLossScale, DynamicLossScale and its rule
(against TensorFlow's reference and a numpy model), their arguments, saving,
serialization and distribution."""

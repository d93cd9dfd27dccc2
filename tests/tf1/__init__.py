"""Tests of the TF1 wrapper, `tf_lossscale.compat.v1`."""

"""Tests of `tf_lossscale.diagnose`."""

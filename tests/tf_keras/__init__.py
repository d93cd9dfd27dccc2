"""Tests of the wrapper with tf-keras (Keras 2) optimizers, many in processes
where `tf.keras` is tf-keras."""

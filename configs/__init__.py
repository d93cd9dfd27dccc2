"""Ready-made JSON configs; installed with the package as tf_lossscale.configs."""

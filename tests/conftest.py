"""Process-wide test setup: four logical CPU devices for multi-replica tests.

TensorFlow fixes its devices when it first initialises them, so the split has
to happen once, when pytest imports this file and before any test runs.
Single-device tests are unaffected: without a strategy everything runs on
CPU:0. Tests needing a fresh process (multi-worker) start their own.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

NUM_LOGICAL_CPUS = 4

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS)

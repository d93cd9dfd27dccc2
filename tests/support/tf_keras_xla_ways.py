"""Runs every way of `tests/support/xla_ways.py` with tf-keras, in one process.

Not a test: `tests/xla/test_xla_ways.py` runs this script with
`TF_USE_LEGACY_KERAS=1` (so `tf.keras` is tf-keras) and reads the one JSON
line it prints last: `{way: "ok" | "<traceback>"}`. One process for them
all: importing TensorFlow costs seconds.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

# Run as a script: the repository's root first on the path, for
# `tests.support`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
from tests.support import xla_ways  # pylint: disable=g-import-not-at-top


def main():
    assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
    print(json.dumps(xla_ways.run_all(tf.keras)), flush=True)


if __name__ == "__main__":
    main()

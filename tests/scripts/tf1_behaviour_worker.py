"""Runs `tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer` the way
TF1 programs do: `tf.compat.v1.disable_v2_behavior()` (reference variables,
TF1 control flow, V1 shapes), a Session, a Saver.

Started by test_tf1_optimizer.py in a process of its own, as the switch is
process-wide. Prints one JSON line: the scale and global step after each
step, our weights and those of TensorFlow's wrapper given the same feeds, and
the state saved and restored by a Saver.
"""

import json
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_v2_behavior()

# Run as a script: the repository's root first on the path, for
# `tests.helpers`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from tests.helpers import reference_oracle as oracle  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.helpers import tf1_graphs  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_lossscale  # pylint: disable=g-import-not-at-top,wrong-import-position

_KINDS = ["finite", "nan", "inf", "finite", "finite"]


def _ours():
    return tf_lossscale.compat.v1.MixedPrecisionLossScaleOptimizer(
        tf1_graphs.adam(), tf_lossscale.DynamicLossScale(2.0**10, 2))


def _tensorflows():
    return tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        tf1_graphs.adam(), oracle.reference_dynamic(2.0**10, 2))


def _plain(state):
    """JSON-able: every array as a list of floats."""
    return [np.asarray(value, np.float64).tolist()
            for key in ("weights", "inner_variables", "loss_scale_variables")
            for value in state[key]]


def main():
    checkpoint = os.path.join(tempfile.mkdtemp(), "ckpt")
    train = tf1_graphs.TrainGraph(_ours)
    ours = tf1_graphs.run_steps(train, _KINDS, seed=3, checkpoint=checkpoint)
    theirs = tf1_graphs.run_steps(tf1_graphs.TrainGraph(_tensorflows),
                                  _KINDS, seed=3)
    print(json.dumps({
        "variable_type": type(train.kernel).__name__,
        "scales": [float(state["scale"]) for state in ours],
        "global_steps": [int(state["global_step"]) for state in ours],
        "ours_weights": [_plain(state)[:2] for state in ours],
        "tensorflows_weights": [_plain(state)[:2] for state in theirs],
        "saved": _plain(ours[-1]),
        "restored": _plain(tf1_graphs.restored_state(_ours, checkpoint)),
    }))


if __name__ == "__main__":
    main()

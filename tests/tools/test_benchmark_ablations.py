"""The benchmark's ablations really take their feature out of the step.

Each ablation (`benchmarks/lsbench/ablations.py`) replaces one part of the
step users run; its cost is read as the difference between the full step and
the ablated one. An ablation that stopped changing the step (a seam the step
no longer goes through) would publish noise as a cost, so each one is traced
here beside the full step, on variables that take every path of the step (a
large kernel, a pack of small gradients of mixed shapes), and must hold fewer
of every op type it claims to remove, and fewer ops in all.
"""

import functools
import sys

import keras
import pytest
import tensorflow as tf

from tests import helpers

sys.path.insert(0, str(helpers.ROOT / "benchmarks"))

from lsbench import ablations  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench import op_counts  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.usefixtures("keras_isolation")

# A large kernel (summed by the check), and small tensors of mixed shapes
# that the unscale packs into one split.
_SHAPES = [(300, 300), (300,), (300, 10), (10,)]


def _traced(make, where):
    if where == "graph":
        return _traced_in_graph(make)
    return ablations.traced_ops(make, _SHAPES, where)


@functools.cache
def _traced_in_graph(make):
    # Once per step: most tests compare with the full one.
    return ablations.traced_ops(make, _SHAPES, "graph")


@pytest.mark.parametrize("ablation", ablations.ABLATIONS,
                         ids=lambda a: a.feature.replace(" ", "_"))
def test_each_ablation_removes_the_ops_it_claims_from_the_traced_step(
        ablation):
    full = _traced(ablations.full, ablation.where)
    ablated = _traced(ablation.make, ablation.where)
    for op_type in ablation.removes:
        assert ablated[op_type] < full[op_type], (
            f"{ablation.feature}: {op_type} {ablated[op_type]} in the "
            f"ablated step, {full[op_type]} in the full one")
    assert sum(ablated.values()) < sum(full.values())


def test_the_removed_ops_are_counted_in_the_branches_too():
    # The overflow record lives in the skip branch, a function of the
    # graph's library: only counting the library sees it go.
    full = _traced(ablations.full, "graph")
    ablated = _traced(ablations.by_feature("the overflow record").make,
                      "graph")
    removed = op_counts.removed(full, ablated)
    assert removed["LogicalNot"] == 1
    assert sum(removed.values()) > 20


def test_ablated_steps_still_train():
    # They are timed in fit: each must run end to end.
    for ablation in ablations.ABLATIONS:
        if ablation.where != "graph":
            continue
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=ablation.make(keras.optimizers.SGD(1e-3)),
                      loss="mse")
        history = model.fit(tf.ones([8, 4]), tf.zeros([8, 2]), verbose=0)
        assert len(history.history["loss"]) == 1, ablation.feature

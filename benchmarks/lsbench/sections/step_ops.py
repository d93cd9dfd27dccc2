"""Ops per tensor of the traced apply step: tf_lossscale's and Keras 3's.

A step over many tensors costs per op as much as per byte: the graph
executor spends about a microsecond on every op, and on every op of a branch
not taken (see `lsbench.op_counts`). This section traces `apply` of both
wrappers (SGD inside) on the gradient sets of the other sections and on the
trainable variables of the `fit` MLP, and counts the ops of each step, both
branches included: the figure a many-tensor step's cost follows. It times
nothing, so its figures are exact and the same on every machine.
"""

import collections

from lsbench import fit_runs
from lsbench import gradient_sets
from lsbench import op_counts

NAME = "ops"
TITLE = "Ops in the traced apply step (both branches), per tensor"


def _mlp_shapes(settings):
    shape = fit_runs.fit_shape(settings)
    return [tuple(v.shape) for v in fit_runs.mlp(shape).trainable_variables]


def _counts(shapes):
    grads = gradient_sets.scaled_gradients(shapes)
    ours, theirs = gradient_sets.sgd_wrappers()
    return (op_counts.traced_apply(ours, grads,
                                   gradient_sets.variables(shapes)),
            op_counts.traced_apply(theirs, grads,
                                   gradient_sets.variables(shapes)))


def run(context):
    report, settings = context.report, context.settings
    report.line(f"\n{NAME}: {TITLE}")
    table = report.table(TITLE, [
        "gradient set", "tensors", "Keras 3: ops (per tensor)",
        "tf_lossscale: ops (per tensor)", "tf_lossscale / Keras 3"])
    sets = dict(gradient_sets.gradient_sets(settings.quick))
    sets["fit MLP"] = _mlp_shapes(settings)
    for set_name, shapes in sets.items():
        ours, theirs = _counts(shapes)
        n = len(shapes)
        total_ours, total_theirs = sum(ours.values()), sum(theirs.values())
        table.add(set_name, n, f"{total_theirs} ({total_theirs / n:.1f})",
                  f"{total_ours} ({total_ours / n:.1f})",
                  f"{total_ours / total_theirs:.2f}")
        more = op_counts.removed(ours, theirs)
        fewer = op_counts.removed(theirs, ours)
        report.line(f"  {set_name}: tf_lossscale has more "
                    f"{_top(more)}; fewer {_top(fewer)}")
    report.show(table)


def _top(counts, top=5):
    counts = collections.Counter(counts)
    return ", ".join(f"{op} {n}" for op, n in counts.most_common(top)) or "-"

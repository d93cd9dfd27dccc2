"""What `tf_lossscale.FailureWatch` costs a healthy run.

1. Interleaved `model.fit` of the MLP of `lsbench.fit_runs`: no loss
   scaling, tf_lossscale, and tf_lossscale with a `FailureWatch` (no
   failure: what every healthy step pays, two reads per batch end), each
   round's times divided by that round's run without loss scaling; without
   XLA and with `jit_compile=True`.
2. The XLA kernels of one training step (`lsbench.kernel_counts`) of a model
   fitted with the watch and of one fitted without it: the watch adds
   nothing to the step, so they are equal.

Target: the watch's cost at most 1% of an unscaled step (as the monitor's),
without XLA.
"""

import tensorflow as tf

import tf_lossscale
from lsbench import ablations
from lsbench import fit_runs
from lsbench import kernel_counts
from lsbench import report as report_module
from lsbench.sections import fit_step

NAME = "watch"
TITLE = "FailureWatch in a healthy model.fit, CPU time over no loss scaling"
TARGET_WATCH = 0.01

_OURS = "tf_lossscale"
_WATCHED = "tf_lossscale + FailureWatch"


def _candidates(shape):
    x, y = fit_runs.data(shape)
    batch = [(x[:shape.batch_size], y[:shape.batch_size])]
    return {
        fit_runs.BASELINE: fit_runs.Candidate(),
        _OURS: fit_runs.Candidate(ablations.full),
        _WATCHED: fit_runs.Candidate(ablations.full, callbacks=(
            lambda: tf_lossscale.FailureWatch(batch, verbose=False),)),
    }


def _kernels(model, shape, quick):
    """The XLA kernels of one train step of `model` (None when quick)."""
    if quick:
        return None
    x, y = fit_runs.data(shape)
    batch = (tf.constant(x[:shape.batch_size]),
             tf.constant(y[:shape.batch_size]))
    step = tf.function(lambda: model.train_step(batch), jit_compile=True)
    return kernel_counts.count(kernel_counts.optimized_hlo(step)).kernels


def run(context):
    """Returns {"fit": cost, "fit_xla": cost, "kernels": (without, with)}
    (costs: CPU, share of an unscaled step)."""
    report, settings = context.report, context.settings
    shape = fit_runs.fit_shape(settings)
    report.line(f"\n{NAME}: {TITLE}: the {shape.depth}x{shape.width} MLP, "
                f"batch {shape.batch_size}, {shape.steps} steps per fit, "
                f"{shape.rounds} rounds")
    table = report.table(TITLE, ["compile", "tf_lossscale", "with the watch",
                                 "the watch", "target"])
    features = report.shared_table(fit_step.FEATURES_TITLE,
                                   fit_step.FEATURES_COLUMNS)
    results = {}
    for key, jit_compile, mode in (("fit", False, "no XLA"),
                                   ("fit_xla", True, "XLA")):
        runs = fit_runs.build(_candidates(shape), shape,
                              jit_compile=jit_compile)
        ratios = fit_runs.interleaved_fits(runs, shape, shape.rounds)
        fit_runs.show(report, ratios)
        cost = ratios.cpu[_WATCHED] - ratios.cpu[_OURS]
        results[key] = cost
        target = ""
        if not jit_compile:
            holds = report.target(
                "FailureWatch's cost per healthy fit step (vs 1%)", cost,
                TARGET_WATCH)
            target = f"≤ 1% {report_module.verdict(holds)}"
        else:
            results["kernels"] = tuple(
                _kernels(runs[name][0], shape, settings.quick)
                for name in (_OURS, _WATCHED))
            report.line(f"  XLA kernels per step without / with the watch: "
                        f"{results['kernels'][0]} / {results['kernels'][1]}"
                        f"{' (not compiled: quick)' if settings.quick else ''}")
        table.add(mode, fit_runs.percent(ratios.overhead(_OURS)),
                  fit_runs.percent(ratios.overhead(_WATCHED)),
                  fit_runs.percent(cost), target)
        features.add("FailureWatch (host reads per batch end; nothing in "
                     "the step)", mode, "-", "-", "-", fit_runs.percent(cost))
    report.show(table)
    return results

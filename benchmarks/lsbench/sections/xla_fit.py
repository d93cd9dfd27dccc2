"""`model.fit` under XLA (`jit_compile=True`, Keras' default on GPUs).

Interleaved fits of the same MLP, compiled with XLA: no loss scaling, Keras
3's wrapper, tf_lossscale as users run it there (a default
`DynamicLossScale`, no callback: it needs no watcher under XLA, and the host
reads nothing per call), and tf_lossscale without the XLA record
(`lsbench.ablations`: the rule alone, no record written and no halt read),
whose difference is what the device-side record costs each step.

Target: tf_lossscale's CPU overhead over no loss scaling at most Keras 3's.
"""

import keras

from lsbench import ablations
from lsbench import fit_runs
from lsbench import report as report_module
from lsbench.sections import fit_step

NAME = "xla"
TITLE = "model.fit under XLA, CPU time over no loss scaling"
TARGET_SHARE_OF_KERAS = 1.0

_KERAS = "Keras 3 LossScaleOptimizer"
_OURS = "tf_lossscale"
_FEATURE = "the XLA record"


def candidates():
    return {
        fit_runs.BASELINE: fit_runs.Candidate(),
        _KERAS: fit_runs.Candidate(keras.optimizers.LossScaleOptimizer),
        _OURS: fit_runs.Candidate(ablations.full),
        f"tf_lossscale without {_FEATURE}": fit_runs.Candidate(
            ablations.by_feature(_FEATURE).make),
    }


def run(context):
    report, settings = context.report, context.settings
    shape = fit_runs.fit_shape(settings)
    report.line(f"\n{NAME}: {TITLE}: the same {shape.depth}x{shape.width} "
                f"MLP, batch {shape.batch_size}, {shape.steps} steps per run, "
                f"{shape.rounds} rounds")
    ratios = fit_runs.interleaved_fits(
        fit_runs.build(candidates(), shape, jit_compile=True), shape,
        shape.rounds)
    fit_runs.show(report, ratios)
    ours, theirs = ratios.overhead(_OURS), ratios.overhead(_KERAS)
    report.line(f"  CPU overhead over no loss scaling under XLA: "
                f"tf_lossscale {ours:+.3f}, Keras 3 {theirs:+.3f}")
    holds = report.target("XLA fit CPU overhead: tf_lossscale's (vs Keras "
                          "3's)", ours, TARGET_SHARE_OF_KERAS * theirs)
    table = report.table(TITLE, ["run", "CPU time", "wall time", "target"])
    for name in ratios.cpu:
        target = (f"≤ Keras 3's {report_module.verdict(holds)}"
                  if name == _OURS else "")
        table.add(name, fit_runs.percent(ratios.overhead(name)),
                  fit_runs.percent(ratios.wall[name] - 1.0), target)
    report.show(table)

    shapes = [tuple(v.shape) for v in fit_runs.mlp(shape).trainable_variables]
    total, removed = ablations.ops_removed(ablations.by_feature(_FEATURE),
                                           shapes)
    cost = ratios.cpu[_OURS] - ratios.cpu[f"tf_lossscale without {_FEATURE}"]
    features = report.shared_table(fit_step.FEATURES_TITLE,
                                   fit_step.FEATURES_COLUMNS)
    features.add(_FEATURE + " (device side; no host read per call)",
                 "XLA", total, removed, "-", fit_runs.percent(cost))

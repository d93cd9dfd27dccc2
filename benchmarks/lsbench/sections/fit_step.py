"""`model.fit` without XLA: what loss scaling adds to a training step.

First the optimizer's step alone on the MLP's gradients (`lsbench.step_costs`:
CPU microseconds per call over plain SGD, for Keras 3's wrapper, tf_lossscale
and each ablation), where a feature's cost is not lost in the noise of a
whole training step. Then interleaved fits of the MLP of `lsbench.fit_runs`:
no loss scaling; the
barrier alone (plain SGD made to wait until every gradient is known before
its first update, as any skip decision must: the part no exact loss scaling
can avoid); Keras 3's wrapper; tf_lossscale; tf_lossscale with its
`LossScaleMonitor`; and tf_lossscale with one feature taken away, for each
feature that holds ops in this step (`lsbench.ablations`): a feature costs
the difference between the full step and its ablation, measured in the same
rounds. The state check and policies are measured twice: the default scale
(the state check alone) and a scale with "warn" and max_consecutive_skips.

Targets: tf_lossscale's CPU overhead over no loss scaling at most Keras
3's; the monitor at most 1% of an unscaled step.
"""

import keras
import tensorflow as tf

import tf_lossscale
from lsbench import ablations
from lsbench import fit_runs
from lsbench import report as report_module
from lsbench import step_costs

NAME = "fit"
TITLE = "model.fit without XLA, CPU time over no loss scaling"
FEATURES_TITLE = "Cost per feature (CPU time)"
FEATURES_COLUMNS = ["feature", "measured in", "ops in the traced step",
                    "ops it removes", "step alone: µs per call",
                    "fit: % of an unscaled step"]
TARGET_SHARE_OF_KERAS = 1.0
TARGET_MONITOR = 0.01

_KERAS = "Keras 3 LossScaleOptimizer"
_OURS = "tf_lossscale"
# The same step timed twice: how far apart two identical runs land is this
# run's noise, printed beside the costs.
_AGAIN = "tf_lossscale, again (the noise)"
_MONITOR = "tf_lossscale + LossScaleMonitor"
_BARRIER = "barrier only (SGD waits for all grads)"
_POLICIES = dict(on_min_loss_scale="warn", max_consecutive_skips=1000)
_WITH_POLICIES = "tf_lossscale, warn + max_consecutive_skips"
_WITHOUT_POLICIES = ("tf_lossscale without the state check and policies, "
                     "warn + limit")


class _BarrierSGD(keras.optimizers.SGD):
    """SGD that waits for every gradient before its first update."""

    def __init__(self, learning_rate):
        super().__init__(learning_rate, name="barrier_sgd")

    def apply(self, grads, trainable_variables=None):
        grads = tf.identity_n(list(grads))
        return super().apply(grads, trainable_variables)


def _without(feature):
    return f"tf_lossscale without {feature}"


def _graph_ablations():
    return [a for a in ablations.ABLATIONS if a.where == "graph"]


def _step_makers():
    """name -> make(inner) for the step-alone measurement."""
    state_check = ablations.by_feature("the state check and policies")
    makers = {_KERAS: keras.optimizers.LossScaleOptimizer,
              _OURS: ablations.full, _AGAIN: ablations.full}
    for ablation in _graph_ablations():
        makers[_without(ablation.feature)] = ablation.make
    makers[_WITH_POLICIES] = lambda inner: ablations.full(inner, **_POLICIES)
    makers[_WITHOUT_POLICIES] = (
        lambda inner: state_check.make(inner, **_POLICIES))
    return makers


def candidates():
    state_check = ablations.by_feature("the state check and policies")
    runs = {
        fit_runs.BASELINE: fit_runs.Candidate(),
        _BARRIER: fit_runs.Candidate(inner=_BarrierSGD),
        _KERAS: fit_runs.Candidate(keras.optimizers.LossScaleOptimizer),
        _OURS: fit_runs.Candidate(ablations.full),
        _AGAIN: fit_runs.Candidate(ablations.full),
        _MONITOR: fit_runs.Candidate(
            ablations.full, callbacks=(tf_lossscale.LossScaleMonitor,)),
    }
    for ablation in _graph_ablations():
        runs[_without(ablation.feature)] = fit_runs.Candidate(ablation.make)
    runs[_WITH_POLICIES] = fit_runs.Candidate(
        lambda inner: ablations.full(inner, **_POLICIES))
    runs[_WITHOUT_POLICIES] = fit_runs.Candidate(
        lambda inner: state_check.make(inner, **_POLICIES))
    return runs


def _mlp_shapes(shape):
    return [tuple(v.shape) for v in fit_runs.mlp(shape).trainable_variables]


def run(context):
    report, settings = context.report, context.settings
    shape = fit_runs.fit_shape(settings)
    report.line(f"\n{NAME}: {TITLE}: a {shape.depth}x{shape.width} MLP, "
                f"mixed_bfloat16 compute, batch {shape.batch_size}, "
                f"{shape.steps} steps per run, {shape.rounds} rounds")
    alone = step_costs.microseconds(_step_makers(), _mlp_shapes(shape),
                                    settings)
    step_table = report.table(
        "The optimizer's step alone on the fit MLP's gradients, CPU µs per "
        "call over plain SGD", ["run", "µs per call"])
    for name, microseconds in alone.items():
        step_table.add(name, f"{microseconds:+.0f}")
    report.show(step_table)
    report.line(f"  step alone: tf_lossscale's overhead / Keras 3's: "
                f"{alone[_OURS] / alone[_KERAS]:.2f}")
    ratios = fit_runs.interleaved_fits(
        fit_runs.build(candidates(), shape), shape, shape.rounds)
    fit_runs.show(report, ratios)
    ours, theirs = ratios.overhead(_OURS), ratios.overhead(_KERAS)
    report.line(f"  CPU overhead over no loss scaling: tf_lossscale "
                f"{ours:+.3f}, Keras 3 {theirs:+.3f}")
    fit_holds = report.target(
        "fit CPU overhead: tf_lossscale's (vs Keras 3's)", ours,
        TARGET_SHARE_OF_KERAS * theirs)
    monitor = ratios.cpu[_MONITOR] - ratios.cpu[_OURS]
    monitor_holds = report.target(
        "LossScaleMonitor's cost per fit step (vs 1%)", monitor,
        TARGET_MONITOR)
    barrier = ratios.overhead(_BARRIER)
    report.line(f"  the barrier alone: {barrier:+.3f}; beyond it: "
                f"tf_lossscale {ours - barrier:+.3f}, Keras 3 "
                f"{theirs - barrier:+.3f}")

    table = report.table(TITLE, ["run", "CPU time", "wall time", "target"])
    for name in ratios.cpu:
        target = ""
        if name == _OURS:
            limit = TARGET_SHARE_OF_KERAS * theirs
            target = (f"≤ Keras 3's ({limit:+.1%}) "
                      f"{report_module.verdict(fit_holds)}")
        elif name == _MONITOR:
            target = (f"monitor {monitor:+.1%} ≤ 1% "
                      f"{report_module.verdict(monitor_holds)}")
        table.add(name, fit_runs.percent(ratios.overhead(name)),
                  fit_runs.percent(ratios.wall[name] - 1.0), target)
    report.show(table)
    _feature_rows(report, ratios, alone, _mlp_shapes(shape))


def _feature_rows(report, ratios, alone, shapes):
    features = report.shared_table(FEATURES_TITLE, FEATURES_COLUMNS)
    rows = [(ablation.feature, ablation, {}, _OURS,
             _without(ablation.feature)) for ablation in _graph_ablations()]
    rows.append((
        "the state check and policies (warn, max_consecutive_skips)",
        ablations.by_feature("the state check and policies"), _POLICIES,
        _WITH_POLICIES, _WITHOUT_POLICIES))
    totals = []
    for feature, ablation, config, full, ablated in rows:
        total, removed = ablations.ops_removed(ablation, shapes, **config)
        totals.append(total)
        if feature == "the state check and policies":
            feature += " (the default scale: the state check alone)"
        features.add(feature, "no XLA", total, removed,
                     f"{alone[full] - alone[ablated]:+.0f}",
                     fit_runs.percent(ratios.cpu[full] - ratios.cpu[ablated]))
    features.add("none (the same step timed twice: this run's noise)",
                 "no XLA", totals[0], 0,
                 f"{alone[_AGAIN] - alone[_OURS]:+.0f}",
                 fit_runs.percent(ratios.cpu[_AGAIN] - ratios.cpu[_OURS]))
    report.show(features)

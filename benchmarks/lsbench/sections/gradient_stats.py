"""What `LossScaleMonitor(gradient_stats=True)` costs (an opt-in feature).

1. The per-step statistics alone (`float16.scaled_gradient_stats`:
   zero-or-subnormal count and largest magnitude) against the finiteness
   check every step already runs (`finiteness.all_finite`), on the
   same gradients (`lsbench.gradient_sets`: a ResNet-50-like set, 1000
   tensors of 1000 values, 4 tensors of 8M values), in interleaved rounds.
2. `model.fit` of the MLP of `lsbench.fit_runs` (mixed_bfloat16 compute:
   under bfloat16 no layer computes in float16, so the monitor itself would
   watch none; the statistics read the float32 gradients, the same work
   either way) with `LossScaleMonitor()`, and with the statistics on, each
   round's times divided by that round's run without loss scaling; without
   XLA and with `jit_compile=True`. The statistics are attached once, as
   the monitor attaches them (every variable watched), before the timed
   fits: this is their cost per step, without the monitor's one retrace
   when training begins and ends.

Targets (issue 49): the statistics at most `TARGET_VS_CHECK` times the
check on every set, and at most `TARGET_FIT_COST` of an unscaled `fit`
step in each compile mode. Its rows in the cost per feature say what
turning it on costs.
"""

import keras
import tensorflow as tf

import tf_lossscale
from lsbench import ablations
from lsbench import fit_runs
from lsbench import gradient_sets
from lsbench import report as report_module
from lsbench import timing
from lsbench.sections import fit_step
from tf_lossscale.ops import finiteness
from tf_lossscale.ops import float16
from tf_lossscale.monitor import gradient_stats

NAME = "stats"
TITLE = "Gradient statistics (opt-in: LossScaleMonitor(gradient_stats=True))"
FEATURE = "gradient statistics (opt-in: LossScaleMonitor(gradient_stats=True))"

TARGET_VS_CHECK = 2.0
TARGET_FIT_COST = 0.06  # A share of an unscaled step, CPU time.

_MONITOR = "tf_lossscale + LossScaleMonitor"
_STATS = "tf_lossscale + LossScaleMonitor + statistics"


def statistics_vs_check(report, settings):
    """Part 1; returns {set name: statistics time / check time} (CPU)."""
    table = report.table(
        f"{TITLE} alone against the finiteness check, same gradients (CPU)",
        ["gradient set", "check (ms)", "statistics (ms)",
         f"statistics / check (≤ {TARGET_VS_CHECK:g})"])
    ratios = {}
    scale = tf.constant(gradient_sets.SCALE)
    for name, shapes in gradient_sets.gradient_sets(settings.quick).items():
        grads = gradient_sets.scaled_gradients(shapes)
        check = tf.function(lambda g=grads: finiteness.all_finite(g))
        stats = tf.function(
            lambda g=grads: float16.scaled_gradient_stats(g, scale))
        samples = timing.interleaved(
            {"check": lambda f=check: f().numpy(),
             "statistics": lambda f=stats: f().numpy()},
            settings.step_rounds, settings.calls)
        ratio = timing.median_ratios(samples.cpu, "check")["statistics"]
        ratios[name] = ratio
        holds = report.target(f"{name}: statistics / check (CPU)", ratio,
                              TARGET_VS_CHECK)
        medians = {k: sorted(v)[len(v) // 2] for k, v in samples.cpu.items()}
        table.add(name, f"{medians['check'] * 1e3:.3f}",
                  f"{medians['statistics'] * 1e3:.3f}",
                  f"x{ratio:.2f} {report_module.verdict(holds)}")
    report.show(table)
    return ratios


class _StatsLogger(keras.callbacks.Callback):
    """What `LossScaleMonitor(gradient_stats=True)` adds to the monitor on
    each batch: one read of the statistics."""

    def __init__(self, stats):
        super().__init__()
        self._stats = stats

    def on_train_batch_end(self, batch, logs=None):
        logs["grad_underflow_share"], logs["grad_headroom_log2"] = (
            self._stats.read())


def _attach(model, callbacks):
    """Attaches the statistics as the monitor does, every variable watched,
    re-makes the train function, and adds their per-batch read."""
    model.optimizer.build(model.trainable_variables)
    stats = gradient_stats.attach(
        model.optimizer, model.trainable_variables, model.distribute_strategy)
    model.make_train_function(force=True)
    callbacks.append(_StatsLogger(stats))


def fit_cost(report, settings, jit_compile):
    """Part 2, one compile mode; returns `fit_runs.Ratios` and the
    statistics' cost (CPU, share of an unscaled step)."""
    shape = fit_runs.fit_shape(settings)
    monitor = fit_runs.Candidate(ablations.full,
                                 callbacks=(tf_lossscale.LossScaleMonitor,))
    runs = fit_runs.build({fit_runs.BASELINE: fit_runs.Candidate(),
                           _MONITOR: monitor, _STATS: monitor}, shape,
                          jit_compile=jit_compile)
    _attach(*runs[_STATS])
    ratios = fit_runs.interleaved_fits(runs, shape, shape.rounds)
    cost = ratios.cpu[_STATS] - ratios.cpu[_MONITOR]
    mode = "XLA (jit_compile=True)" if jit_compile else "no XLA"
    report.line(f"  {shape.depth}x{shape.width} MLP, batch "
                f"{shape.batch_size}, {shape.steps} steps per fit, "
                f"{shape.rounds} rounds, {mode}:")
    fit_runs.show(report, ratios)
    report.line(f"  {mode}: CPU time x{ratios.cpu[_STATS] / ratios.cpu[_MONITOR]:.3f}"
                f", wall time x{ratios.wall[_STATS] / ratios.wall[_MONITOR]:.3f}"
                f" (with the statistics / without); the statistics cost "
                f"{fit_runs.percent(cost)} of an unscaled step")
    holds = report.target(f"{mode}: the statistics' share of an unscaled "
                          "fit step (CPU)", cost, TARGET_FIT_COST)
    return ratios, cost, holds


def run(context):
    """Returns {"statistics_vs_check": {set: ratio}, "fit": cost,
    "fit_xla": cost} (costs: CPU, share of an unscaled step)."""
    report, settings = context.report, context.settings
    report.line(f"\n{NAME}: {TITLE}: the statistics alone against the "
                "finiteness check, then model.fit with the monitor, with and "
                "without them")
    results = {"statistics_vs_check": statistics_vs_check(report, settings)}
    table = report.table(
        f"{TITLE} in model.fit with LossScaleMonitor, CPU time over no loss "
        "scaling", ["compile", "monitor", "monitor + statistics",
                    f"the statistics (≤ +{TARGET_FIT_COST:.0%})"])
    features = report.shared_table(fit_step.FEATURES_TITLE,
                                   fit_step.FEATURES_COLUMNS)
    for key, jit_compile, mode in (("fit", False, "no XLA"),
                                   ("fit_xla", True, "XLA")):
        ratios, cost, holds = fit_cost(report, settings, jit_compile)
        results[key] = cost
        table.add(mode, fit_runs.percent(ratios.overhead(_MONITOR)),
                  fit_runs.percent(ratios.overhead(_STATS)),
                  f"{fit_runs.percent(cost)} {report_module.verdict(holds)}")
        features.add(FEATURE, mode, "-", "-", "-", fit_runs.percent(cost))
    report.show(table)
    return results

"""Per-layer gradient scaling (`tf_lossscale.layerwise`): its gain on a model
no single loss scale fits, and its cost per step.

The gain: `lsbench.per_layer_demo` trains its model in float32, with one
loss scale (dynamic, and fixed at the top of the range the diagnosis
advises) and scaled per layer, and prints the loss curves side by side, and
each variable's underflow share (`diagnose`'s measure) at the scale the
single-scale run and the per-layer run ended with.

The cost: the `fit` MLP compiled with the single-scale wrapper and scaled
per layer with every layer its own segment (`segments="layers"`: its
gradients sit in one range, so segments from their magnitudes would make
one): the ops of the traced train step (forward, backward and apply, both
branches of every `tf.cond`), the top-level instructions of the
XLA-optimized HLO of the same step (each fusion one: about one kernel
each), and `model.fit`'s CPU time per step, interleaved with a run without
loss scaling.

Targets: the per-layer run's final loss within 10% of float32's; its ops,
XLA instructions and `fit` overhead (CPU time over no loss scaling) at most
1.3 times one scale's.
"""

import re
import warnings

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale
from tf_lossscale import layerwise

from lsbench import fit_runs
from lsbench import op_counts
from lsbench import per_layer_demo

NAME = "layerwise"
TITLE = "Per-layer gradient scaling"
TARGET_LOSS_RATIO = 1.1
TARGET_COST_RATIO = 1.3

_SINGLE = "single scale (tf_lossscale)"
_LAYERWISE = "per-layer scaling"


def _hlo_instructions(text):
    """The instructions of the ENTRY computation of an HLO module's text."""
    entry = text[text.index("\nENTRY "):]
    body = entry[entry.index("{") + 1:entry.index("\n}")]
    return sum(1 for line in body.splitlines() if re.match(r"\s*\S+ = ", line))


def _train_step(model, x, y, jit_compile):
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function(jit_compile=jit_compile)
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = model.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)

    return step


def _models(shape):
    """{name: (compiled model, callbacks)}: no loss scaling, the single-scale
    wrapper, and the same scaled per layer, under mixed_bfloat16 as the other
    `fit` sections (`fit_runs`)."""
    runs = fit_runs.build({
        fit_runs.BASELINE: fit_runs.Candidate(),
        _SINGLE: fit_runs.Candidate(tf_lossscale.LossScaleOptimizer),
    }, shape)
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        with warnings.catch_warnings():
            # That bfloat16 needs no scaling: the scaling is what is measured.
            warnings.simplefilter("ignore", UserWarning)
            runs[_LAYERWISE] = (layerwise.scale_per_layer(
                runs[_SINGLE][0], segments="layers"), [])
    finally:
        keras.mixed_precision.set_global_policy(previous)
    return runs


def _cost(report, settings):
    shape = fit_runs.fit_shape(settings)
    runs = _models(shape)
    x, y = fit_runs.data(shape)
    x, y = x[:shape.batch_size], y[:shape.batch_size]
    segments = len(runs[_LAYERWISE][0].segments)
    report.line(f"  cost: the {shape.depth}x{shape.width} MLP of `fit` "
                f"({segments} segments), batch {shape.batch_size}")
    counts = {}
    for name in (_SINGLE, _LAYERWISE):
        model = runs[name][0]
        model.optimizer.build(model.trainable_variables)
        ops = sum(op_counts.op_types(_train_step(model, x, y, False)).values())
        # Quick runs skip the XLA compilation (tests/layerwise runs XLA).
        hlo = "-" if settings.quick else _hlo_instructions(
            _train_step(model, x, y, True).experimental_get_compiler_ir()(
                stage="optimized_hlo"))
        counts[name] = (ops, hlo)
    ratios = fit_runs.interleaved_fits(runs, shape, shape.rounds)
    fit_runs.show(report, ratios)
    table = report.table(f"{TITLE}: cost per step against one loss scale", [
        "run", "ops in the traced step", "XLA top-level HLO instructions",
        "fit CPU time over no loss scaling"])
    for name in (_SINGLE, _LAYERWISE):
        ops, hlo = counts[name]
        table.add(name, ops, hlo, fit_runs.percent(ratios.overhead(name)))
    single_ops, single_hlo = counts[_SINGLE]
    ops, hlo = counts[_LAYERWISE]
    table.add("per-layer / single", f"{ops / single_ops:.2f}",
              "-" if settings.quick else f"{hlo / single_hlo:.2f}",
              f"x{ratios.cpu[_LAYERWISE] / ratios.cpu[_SINGLE]:.3f}")
    report.show(table)
    report.target("cost: per-layer ops / one scale's", ops / single_ops,
                  TARGET_COST_RATIO)
    if not settings.quick:
        report.target("cost: per-layer XLA instructions / one scale's",
                      hlo / single_hlo, TARGET_COST_RATIO)
    report.target("cost: per-layer fit overhead / one scale's",
                  ratios.overhead(_LAYERWISE) / ratios.overhead(_SINGLE),
                  TARGET_COST_RATIO)
    return {"segments": segments, "counts": counts, "cpu": ratios.cpu}


def _demonstration(report, settings):
    if settings.quick:  # Every path once, on one batch.
        steps, points, width, examples = 4, 2, 8, per_layer_demo.BATCH
        scales = [2.0 ** k for k in range(0, 33, 8)]
    else:
        steps, points, width, examples, scales = 300, 10, 32, 256, None
    results, diagnosis, trained = per_layer_demo.runs(
        steps, points, width, examples, scales)
    report.line(f"  demonstration: {steps} steps of batch "
                f"{per_layer_demo.BATCH}, loss averaged over {points} parts; "
                f"the diagnosis advises loss scales "
                f"{diagnosis.loss_scale_range} and float32 for "
                f"{diagnosis.keep_in_float32}")
    curves = report.table(f"{TITLE}: loss of the demonstration model", [
        "run"] + [f"steps {i * steps // points + 1}-{(i + 1) * steps // points}"
                  for i in range(points)] + ["loss scale, skipped steps"])
    for name, run in results.items():
        scales = "-" if run.scale is None else (
            f"2^{np.log2(run.scale):.0f}, {run.skipped}")
        curves.add(name, *[f"{loss:.4f}" for loss in run.losses], scales)
    report.show(curves)
    layer_run = results["per-layer scaling"]
    report.line("  factors at the end: " + ", ".join(
        f"{name} 2^{np.log2(f):.0f}" for name, f in layer_run.factors.items()))
    # Each run's model as it ended, at the scale it ended with.
    measured = {name: per_layer_demo.underflow_shares(
        trained[name], results[name].scale, examples)
                for name in results if results[name].scale is not None}
    shares = report.table(
        f"{TITLE}: underflow share of each variable's gradient", [
            "variable", "float32"] + [
                f"{name}, at 2^{np.log2(results[name].scale):.0f}"
                for name in measured])
    for variable in next(iter(measured.values())):
        shares.add(variable, "0 (the reference)", *[
            f"{share[variable]:.3f}" for share in measured.values()])
    report.show(shares)
    final = {name: run.losses[-1] for name, run in results.items()}
    ratio = final["per-layer scaling"] / final["float32"]
    report.target("demonstration: per-layer final loss / float32's", ratio,
                  TARGET_LOSS_RATIO)
    return {"final_loss": final, "shares": measured}


def run(context):
    report, settings = context.report, context.settings
    report.line(f"\n{NAME}: {TITLE}")
    demonstration = _demonstration(report, settings)
    cost = _cost(report, settings)
    return {"demonstration": demonstration, "cost": cost}

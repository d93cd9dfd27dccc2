"""The hot path's techniques, each against the plain form.

On the three gradient sets, in graph mode (`tf.function`) and under XLA
(`jit_compile=True`), every form of `lsbench.hot_path_forms` and the
package's own run in one interleaved call per set and mode, in groups: the
check; the unscale; the unscale then the check, as the step runs them; the
per-gradient flags of a skipped step (after the package's unscale); and the
whole Keras-protocol apply step (SGD), with the package's parts and with
plain ones (`hot_path_forms.PlainParts`). Each group holds its plain form
twice: how far apart the two land is that group's noise in this run.

Reported per form: the ops of its traced function (exact; both branches of
a `tf.cond` counted, `lsbench.op_counts`), and median per-round ratios of
CPU time (wall time beside) to its group's plain form, in each mode. Before
timing, every form's results are compared with the plain form's, bit for
bit, on the set and on the set with a NaN in its last gradient (graph mode).

A technique earns its place (the last column) when it cuts the traced ops by
a third or more, or is faster than the plain form by more than the noise.
No target: the decisions are the package's (docs/guides/performance.md).

Quick runs measure XLA on the first set only (the one that takes every
path: tiny, small and large gradients): each form still runs in both modes.
"""

import statistics

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale
from lsbench import gradient_sets
from lsbench import hot_path_forms as forms
from lsbench import op_counts
from lsbench import timing
from tf_lossscale.ops import finiteness
from tf_lossscale.ops import unscaling

NAME = "hotpath"
TITLE = "The hot path: each technique against the plain form"
PLAIN = "plain"
AGAIN = "plain, again (the noise)"
PACKAGE = "the package"
OP_CUT = 1 / 3
MODES = (("graph", False), ("XLA", True))  # (name, jit_compile)


def _both(unscale, check):
    """The unscale, then the check of its quotients, as the step runs them;
    both results returned, as the step uses both."""

    def run(grads, scale):
        unscaled = unscale(grads, scale)
        return unscaled, check(unscaled)

    return run


def _groups():
    """group -> {form: fn(grads, scale)}; each group's first form is its
    plain one, its second the plain one again."""
    packed = lambda g, s: forms.unscale(g, s, packed=True)
    plain_both = _both(forms.plain_unscale, forms.plain_check)
    flags_after = lambda flags: lambda g, s: flags(unscaling.unscale(g, s))
    return {
        "check": {
            PLAIN: lambda g, s: forms.plain_check(g),
            AGAIN: lambda g, s: forms.plain_check(g),
            "stacking": lambda g, s: forms.check(g, stack=True),
            "sum sentinel": lambda g, s: forms.check(g, sentinel=True),
            PACKAGE: lambda g, s: finiteness.all_finite(g),
        },
        "unscale": {
            PLAIN: forms.plain_unscale,
            AGAIN: forms.plain_unscale,
            "packed": packed,
            PACKAGE: unscaling.unscale,
        },
        "unscale + check": {
            PLAIN: plain_both,
            AGAIN: plain_both,
            "packed unscale": _both(packed, forms.plain_check),
            "packed unscale, stacking": _both(
                packed, lambda g: forms.check(g, stack=True)),
            "packed unscale, check through its split": _both(
                packed, lambda g: forms.check(g, through_split=True)),
            PACKAGE: _both(unscaling.unscale, finiteness.all_finite),
        },
        "flags of a skipped step": {
            PLAIN: flags_after(forms.plain_flags),
            AGAIN: flags_after(forms.plain_flags),
            "through the unscale's split": flags_after(forms.split_flags),
            PACKAGE: flags_after(finiteness.nonfinite_flags),
        },
    }


def _apply_steps(shapes, jit_compile):
    """The apply step with plain parts (twice) and the package's: name ->
    a `tf.function` (Keras protocol, SGD)."""
    steps = {}
    for name, optimizer_class in ((PLAIN, forms.PlainParts),
                                  (AGAIN, forms.PlainParts),
                                  (PACKAGE, tf_lossscale.LossScaleOptimizer)):
        optimizer = optimizer_class(
            keras.optimizers.SGD(1e-9),
            loss_scale=tf_lossscale.DynamicLossScale(
                gradient_sets.SCALE, increment_period=10 ** 9))
        grads = gradient_sets.scaled_gradients(shapes)
        variables = gradient_sets.variables(shapes)
        optimizer.build(variables)
        optimizer.scale_loss(tf.constant(1.0))  # The Keras 3 protocol.
        steps[name] = tf.function(
            lambda o=optimizer, g=grads, v=variables: o.apply(g, v),
            jit_compile=jit_compile)
    return steps


def _with_nan(grads):
    """`grads` with the last value of the last gradient a NaN."""
    values = grads[-1].numpy().copy()
    values.reshape(-1)[-1] = np.nan
    return grads[:-1] + [tf.constant(values)]


def check_same_results(groups, grads):
    """Raises unless every form of a group gives its plain form's results
    bit for bit (graph mode), on `grads` and with a NaN among them."""
    scale = tf.constant(gradient_sets.SCALE)
    for inputs in (grads, _with_nan(grads)):
        for group, candidates in groups.items():
            # One trace for the group's forms, not one each: tracing is
            # what costs here.
            results = tf.function(lambda c=candidates, i=inputs: {
                name: fn(i, scale) for name, fn in c.items()})()
            plain = _bytes(results.pop(PLAIN))
            for name in candidates:
                if name != PLAIN and _bytes(results.pop(name)) != plain:
                    raise AssertionError(f"{group}: {name!r} differs from "
                                         "the plain form")


def _bytes(result):
    return [np.asarray(r).tobytes() for r in tf.nest.flatten(result)]


def _measure(groups, grads, shapes, jit_compile, settings):
    """{(group, form): (traced ops, CPU ratio, wall ratio)}, ratios to the
    group's plain form, for one compile mode."""
    scale = tf.Variable(gradient_sets.SCALE)
    functions = {
        (group, name): tf.function(
            lambda f=fn: f(grads, scale.read_value()), jit_compile=jit_compile)
        for group, candidates in groups.items()
        for name, fn in candidates.items()}
    for name, step in _apply_steps(shapes, jit_compile).items():
        functions[("apply step", name)] = step
    ops = {key: sum(op_counts.op_types(fn).values())
           for key, fn in functions.items()}
    samples = timing.interleaved(functions, settings.step_rounds,
                                 settings.calls)

    def ratio(times, key):
        base = times[(key[0], PLAIN)]
        return statistics.median(t / b for t, b in zip(times[key], base))

    return {key: (ops[key], ratio(samples.cpu, key), ratio(samples.wall, key))
            for key in functions}


def _earns(ops, plain_ops, ratios, noises):
    """Why a form earns its place by the rule, or "-"."""
    reasons = []
    if ops <= (1 - OP_CUT) * plain_ops:
        reasons.append(f"ops -{1 - ops / plain_ops:.0%}")
    reasons += [f"time ({mode})" for mode, ratio in ratios.items()
                if ratio < 1 - noises[mode]]
    return ", ".join(reasons) or "-"


def run(context):
    report, settings = context.report, context.settings
    report.line(f"\n{NAME}: {TITLE}")
    groups = _groups()
    sets = gradient_sets.gradient_sets(settings.quick)
    for index, (set_name, shapes) in enumerate(sets.items()):
        grads = gradient_sets.scaled_gradients(shapes)
        check_same_results(groups, grads)
        measured = MODES if index == 0 or not settings.quick else MODES[:1]
        modes = {mode: _measure(groups, grads, shapes, jit, settings)
                 for mode, jit in measured}
        skipped = "" if measured == MODES else "; quick: no XLA on this set"
        report.line(f"\n  {set_name}: {len(shapes)} tensors, "
                    f"{gradient_sets.values(shapes):,} values; ratios to the "
                    f"plain form: CPU time (wall time){skipped}")
        table = report.table(f"{TITLE}: {set_name}", [
            "group", "form", "ops (x plain)", "graph: CPU x plain",
            "XLA: CPU x plain", "earns its place"])
        for (group, name), (ops, _, _) in modes["graph"].items():
            key = (group, name)
            plain_ops = modes["graph"][(group, PLAIN)][0]
            earns = ""
            if name != PLAIN:
                earns = "(the noise)" if name == AGAIN else _earns(
                    ops, plain_ops, {m: r[key][1] for m, r in modes.items()},
                    {m: abs(r[(group, AGAIN)][1] - 1)
                     for m, r in modes.items()})
            report.line(f"  {group:<24} {name:<40} ops {ops:>5}  " + "  ".join(
                f"{m} {r[key][1]:.3f} ({r[key][2]:.3f})"
                for m, r in modes.items()) + f"  {earns}")
            table.add(group, name, f"{ops} ({ops / plain_ops:.2f})",
                      *[f"{modes[m][key][1]:.3f}" if m in modes else "-"
                        for m, _ in MODES], earns)
        report.show(table)

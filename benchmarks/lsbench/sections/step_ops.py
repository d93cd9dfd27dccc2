"""Ops and XLA kernels per apply step: tf_lossscale, Keras 3's, the plain form.

What a step costs on a GPU is mostly what it launches, which a CPU's wall
time hides; both counts below are exact and the same on every machine with
the same TensorFlow, and need no GPU:

* graph ops: the ops of the step traced as a `tf.function`, both branches
  of every `tf.cond` (`lsbench.op_counts`): without XLA each is a kernel
  launch on a GPU, and the executor visits the ops of a branch not taken;
* XLA kernels: what the step compiled with `jit_compile=True` (Keras'
  default on GPUs) launches when it applies finite gradients, read from the
  optimized HLO (`lsbench.kernel_counts`, which states the rules), and of
  those, the conditionals: each reads its predicate on the host first.

Candidates, each `apply` of scaled gradients with SGD inside: tf_lossscale's
wrapper, Keras 3's, and the plain form (tf_lossscale's step with the check
and the unscale of jmp and Keras 3: `is_finite` and a divide per tensor,
`hot_path_forms.PlainParts`), on the gradient sets of the other sections and
on the trainable variables of the `fit` MLP.

Target: fewer XLA kernels per step than Keras 3's wrapper on every set.
Quick runs compile the first set alone (the one that takes every path).
"""

import keras
import tensorflow as tf

import tf_lossscale
from lsbench import fit_runs
from lsbench import gradient_sets
from lsbench import hot_path_forms
from lsbench import kernel_counts
from lsbench import op_counts
from lsbench import report as report_module

NAME = "ops"
TITLE = ("Ops and XLA kernels per apply step: tf_lossscale, Keras 3's "
         "wrapper and the plain form")

OURS = "tf_lossscale"
KERAS = "Keras 3"
PLAIN = "plain form"
FORMS = (OURS, KERAS, PLAIN)


def _mlp_shapes(settings):
    shape = fit_runs.fit_shape(settings)
    return [tuple(v.shape) for v in fit_runs.mlp(shape).trainable_variables]


def make(form):
    """A new optimizer of `form` around SGD(1e-9), never growing its scale:
    the candidates of the step-level sections."""
    if form == KERAS:
        return gradient_sets.sgd_wrappers()[1]
    wrapper = {OURS: tf_lossscale.LossScaleOptimizer,
               PLAIN: hot_path_forms.PlainParts}[form]
    return wrapper(keras.optimizers.SGD(1e-9),
                   loss_scale=tf_lossscale.DynamicLossScale(
                       gradient_sets.SCALE, increment_period=10 ** 9))


def _compiled_apply(optimizer, grads, variables):
    # A closure, not default arguments: the compiler IR is asked for
    # without arguments.
    return tf.function(lambda: optimizer.apply(grads, variables),
                       jit_compile=True)


def counts(form, shapes, compile_xla=True):
    """(graph ops, `kernel_counts.Launches` or None if not `compile_xla`)
    of one apply step of `form` on gradients of `shapes`."""
    grads = gradient_sets.scaled_gradients(shapes)
    optimizer, variables = make(form), gradient_sets.variables(shapes)
    # Both are traced or compiled only: nothing runs.
    ops = sum(op_counts.traced_apply(optimizer, grads, variables).values())
    if not compile_xla:
        return ops, None
    launches = kernel_counts.count(kernel_counts.optimized_hlo(
        _compiled_apply(optimizer, grads, variables)))
    return ops, launches


def run(context):
    """Returns {set name: {form: (graph ops, Launches)}}."""
    report, settings = context.report, context.settings
    report.line(f"\n{NAME}: {TITLE}")
    table = report.table(TITLE, [
        "gradient set", "tensors",
        *[f"graph ops: {form}" for form in FORMS],
        *[f"XLA kernels: {form}" for form in FORMS],
        "conditionals (host waits)", "kernels < Keras 3's"])
    sets = dict(gradient_sets.gradient_sets(settings.quick))
    sets["fit MLP"] = _mlp_shapes(settings)
    results = {}
    for index, (set_name, shapes) in enumerate(sets.items()):
        # Quick runs compile the first set alone, the one that takes every
        # path (compiling is what costs here).
        compile_xla = index == 0 or not settings.quick
        measured = {form: counts(form, shapes, compile_xla) for form in FORMS}
        results[set_name] = measured
        n = len(shapes)
        for form, (ops, launches) in measured.items():
            kernels = ("not compiled (quick)" if launches is None
                       else kernel_counts.describe(launches))
            report.line(f"  {set_name}: {form}: graph ops {ops} "
                        f"({ops / n:.1f} per tensor); XLA kernels {kernels}")
        graph_ops = [measured[form][0] for form in FORMS]
        if not compile_xla:
            table.add(set_name, n, *graph_ops, *["-"] * len(FORMS), "-", "-")
            continue
        ours, theirs = measured[OURS][1], measured[KERAS][1]
        holds = report.target(
            f"{set_name}: XLA kernels per step, at most Keras 3's - 1",
            ours.kernels, theirs.kernels - 1)
        table.add(set_name, n, *graph_ops,
                  *[measured[form][1].kernels for form in FORMS],
                  " / ".join(str(measured[form][1].conditionals)
                             for form in FORMS),
                  f"{ours.kernels / theirs.kernels:.2f} "
                  f"{report_module.verdict(holds)}")
    report.show(table)
    return results

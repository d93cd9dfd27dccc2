"""The Keras-protocol apply path on the three gradient sets.

Scaled gradients into `apply` with an SGD inner optimizer (learning rate
1e-9), each a `tf.function`: tf_lossscale's wrapper, Keras 3's wrapper, a
bare `SGD.apply(g * 1/scale)`, and tf_lossscale without its finiteness check
and without its unscale (`lsbench.ablations`): what each costs is the
difference from the full step, a profile measured side by side. Ratios are
to Keras 3's wrapper, in CPU time (wall time beside it); target:
tf_lossscale at most 0.95x on every set (the aim, shown beside it: 0.9x).
"""

import keras
import tensorflow as tf

from lsbench import ablations
from lsbench import gradient_sets
from lsbench import report as report_module
from lsbench import timing

NAME = "apply"
TITLE = "Apply path (Keras protocol, SGD), x Keras 3's wrapper"
TARGET_VS_KERAS = 0.95
AIM_VS_KERAS = 0.9

_KERAS = "Keras 3 LossScaleOptimizer.apply"
_OURS = "tf_lossscale LossScaleOptimizer.apply"
_BARE = "bare SGD.apply(g * 1/scale)"
_WITHOUT = {feature: f"tf_lossscale without {feature}"
            for feature in ("the finiteness check", "the unscale")}


def _candidates(shapes):
    grads = gradient_sets.scaled_gradients(shapes)
    ours_vars = gradient_sets.variables(shapes)
    keras_vars = gradient_sets.variables(shapes)
    bare_vars = gradient_sets.variables(shapes)
    ours, keras_wrapper = gradient_sets.sgd_wrappers()
    bare_sgd = keras.optimizers.SGD(1e-9)
    scale = tf.Variable(gradient_sets.SCALE)
    ours.scale_loss(tf.constant(1.0))  # The Keras 3 protocol.

    @tf.function
    def ours_apply():
        ours.apply(grads, ours_vars)

    @tf.function
    def keras_apply():
        keras_wrapper.apply(grads, keras_vars)

    @tf.function
    def bare_apply():
        inverse = 1.0 / scale
        bare_sgd.apply([g * inverse for g in grads], bare_vars)

    candidates = {_KERAS: keras_apply, _OURS: ours_apply, _BARE: bare_apply}
    for feature, name in _WITHOUT.items():
        candidates[name] = _ablated_apply(feature, grads, shapes)
    return candidates


def _ablated_apply(feature, grads, shapes):
    optimizer = ablations.by_feature(feature).make(
        keras.optimizers.SGD(1e-9), initial_loss_scale=gradient_sets.SCALE,
        increment_period=10 ** 9)
    variables = gradient_sets.variables(shapes)
    optimizer.scale_loss(tf.constant(1.0))
    return tf.function(lambda: optimizer.apply(grads, variables))


def run(context):
    report, settings = context.report, context.settings
    report.line(f"\n{NAME}: {TITLE}")
    table = report.table(TITLE, [
        "gradient set", "tf_lossscale: CPU (wall)", "bare SGD: CPU (wall)",
        "its check", "its unscale", f"target ≤ {TARGET_VS_KERAS} (CPU)",
        f"aim ≤ {AIM_VS_KERAS}"])
    for set_name, shapes in gradient_sets.gradient_sets(
            settings.quick).items():
        samples = timing.interleaved(_candidates(shapes),
                                     settings.step_rounds, settings.calls)
        ratios = timing.median_ratios(samples.cpu, _KERAS)
        wall = timing.median_ratios(samples.wall, _KERAS)
        report.line(f"\n  {set_name}{'':<27} CPU time  wall time")
        for name, ratio in ratios.items():
            report.line(f"  {name:<40} x{ratio:.3f}   x{wall[name]:.3f}")
        holds = report.target(f"{set_name}: apply path / Keras 3's (CPU)",
                              ratios[_OURS], TARGET_VS_KERAS)
        costs = {feature: ratios[_OURS] - ratios[name]
                 for feature, name in _WITHOUT.items()}
        table.add(set_name, f"{ratios[_OURS]:.2f} ({wall[_OURS]:.2f})",
                  f"{ratios[_BARE]:.2f} ({wall[_BARE]:.2f})",
                  *[f"{cost:+.2f}" for cost in costs.values()],
                  report_module.verdict(holds),
                  report_module.verdict(ratios[_OURS] <= AIM_VS_KERAS))
    report.show(table)

"""Check + unscale + update on the three gradient sets (TF 2.x protocol).

Candidates, each a `tf.function` over constant scaled gradients: a bare
unscale (one multiply per gradient), Keras 3's `check_finite` and its
divide, TensorFlow's reference (divide, then `update`), tf_lossscale's TF
2.x protocol (`get_unscaled_gradients`, then `loss_scale.update`) and
tf_lossscale's finiteness check alone. Ratios are to the bare unscale, in
CPU time (the wall-time ratios are printed beside them).

Targets: tf_lossscale at most 0.85x the faster reference (Keras 3 or TF);
on large gradients, the check alone at most 0.5x the bare unscale.
"""

import keras
import tensorflow as tf

import tf_lossscale
from lsbench import gradient_sets
from lsbench import report as report_module
from lsbench import timing

NAME = "check"
TITLE = ("Check + unscale + update (TF 2.x protocol), x the bare unscale, "
         "CPU time")
TARGET_VS_REFERENCE = 0.85
TARGET_CHECK_VS_BARE = 0.5  # On large gradients only.

_BARE = "bare unscale"
_KERAS = "Keras 3 check_finite + divide"
_REFERENCE = "TF reference (divide + update)"
_OURS = "tf_lossscale (TF2 protocol)"
_CHECK = "tf_lossscale check alone"


def _candidates(shapes):
    scale_value = gradient_sets.SCALE
    grads = gradient_sets.scaled_gradients(shapes)
    keras_wrapper = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=scale_value)
    keras_wrapper.build([tf.Variable(tf.zeros([1]))])
    reference = tf.compat.v1.mixed_precision.DynamicLossScale(
        scale_value, increment_period=10 ** 9)
    ours = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(), loss_scale=tf_lossscale.DynamicLossScale(
            scale_value, increment_period=10 ** 9))
    scale = tf.Variable(scale_value)

    @tf.function
    def bare():
        inverse = 1.0 / scale
        return [g * inverse for g in grads]

    @tf.function
    def keras_check_divide():
        finite = keras_wrapper.check_finite(grads)
        divisor = keras_wrapper.dynamic_scale
        return [g / divisor for g in grads], finite

    @tf.function
    def tf_reference():
        divisor = reference()
        unscaled = [g / divisor for g in grads]
        return unscaled, reference.update(unscaled)[1]

    @tf.function
    def tf_lossscale_tf2():
        unscaled = ours.get_unscaled_gradients(grads)
        return unscaled, ours.loss_scale.update(unscaled)[1]

    @tf.function
    def tf_lossscale_check():
        return ours.check_finite(grads)

    return {_BARE: bare, _KERAS: keras_check_divide,
            _REFERENCE: tf_reference, _OURS: tf_lossscale_tf2,
            _CHECK: tf_lossscale_check}


def run(context):
    report, settings = context.report, context.settings
    report.line(f"\n{NAME}: {TITLE}")
    table = report.table(TITLE, [
        "gradient set", "Keras 3", "TF reference", "tf_lossscale",
        "check alone", f"÷ faster reference (≤ {TARGET_VS_REFERENCE})",
        f"check alone (≤ {TARGET_CHECK_VS_BARE}, large sets)"])
    for set_name, shapes in gradient_sets.gradient_sets(
            settings.quick).items():
        samples = timing.interleaved(_candidates(shapes),
                                     settings.step_rounds, settings.calls)
        ratios = timing.median_ratios(samples.cpu, _BARE)
        wall = timing.median_ratios(samples.wall, _BARE)
        report.line(f"\n  {set_name}: {len(shapes)} tensors, "
                    f"{gradient_sets.values(shapes):,} values; CPU time, "
                    "wall time")
        for name, ratio in ratios.items():
            report.line(f"  {name:<40} x{ratio:.3f}   x{wall[name]:.3f}")
        vs_reference = ratios[_OURS] / min(ratios[_KERAS], ratios[_REFERENCE])
        holds = report.target(f"{set_name}: tf_lossscale / faster reference",
                              vs_reference, TARGET_VS_REFERENCE)
        check_cell = "(not a large set)"
        if gradient_sets.is_large(shapes):
            check_holds = report.target(
                f"{set_name}: tf_lossscale's check alone / bare unscale",
                ratios[_CHECK], TARGET_CHECK_VS_BARE)
            check_cell = report_module.verdict(check_holds)
        table.add(set_name, f"{ratios[_KERAS]:.2f}",
                  f"{ratios[_REFERENCE]:.2f}", f"{ratios[_OURS]:.2f}",
                  f"{ratios[_CHECK]:.2f}",
                  f"{vs_reference:.2f} {report_module.verdict(holds)}",
                  check_cell)
    report.show(table)

"""tf-keras guide claims, in a tf-keras process: the legacy wrapper's
variable order, a TF 2.3 config with a multiplier of 3, and the warning of
a wrapper made under a bfloat16 policy.

Not a test: tests/tf_keras/test_wrapper_layout_and_old_configs.py runs each
function in the session's
`tf_keras_interpreter` (`TF_USE_LEGACY_KERAS=1`), which answers as JSON what
it computed in that process.
"""

import warnings

import numpy as np
import tensorflow as tf

import tf_lossscale

keras = tf.keras


def legacy_wrapper_variable_order():
    """tf-keras.md: the legacy class's `weights`, `variables()` and
    `get_weights()` are the inner optimizer's, then the loss scale's, then the
    wrapper's own (`skipped_steps`, the overflow flags)."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = tf_lossscale.LossScaleOptimizer(
        keras.optimizers.legacy.Adam(0.1),
        loss_scale=tf_lossscale.DynamicLossScale(64.0))
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    optimizer.apply_gradients(zip(optimizer.get_unscaled_gradients(
        [g * optimizer.loss_scale() for g in grads]),
                                  model.trainable_variables))
    inner = [id(v) for v in optimizer.inner_optimizer.weights]
    scale = [id(v) for v in optimizer.loss_scale.variables]
    weights = optimizer.weights
    # A weight that is none of these is the wrapper's own.
    own = [v for v in weights if id(v) not in set(inner + scale)]
    values = optimizer.get_weights()
    return {
        "class": type(optimizer).__name__,
        "weights": [id(v) for v in weights],
        "variables": [id(v) for v in optimizer.variables()],
        "expected": inner + scale + [id(v) for v in own],
        "inner_count": len(inner),
        "own_names": [v.name.split(":")[0] for v in own],
        "get_weights_equal": len(values) == len(weights) and all(
            np.array_equal(a, v.numpy()) for a, v in zip(values, weights)),
    }


def tf_2_3_config_with_multiplier_3():
    """tf-keras.md: "A TF 2.3 config whose `DynamicLossScale` has a
    multiplier other than 2 ... loads, with its multiplier"."""
    rule = {"initial_loss_scale": 64.0, "increment_period": 1,
            "multiplier": 3.0}
    config = {"optimizer": {"class_name": "SGD",
                            "config": {"name": "SGD", "learning_rate": 0.1,
                                       "decay": 0.0, "momentum": 0.0,
                                       "nesterov": False}},
              "loss_scale": {"class_name": "DynamicLossScale",
                             "config": dict(rule)}}
    optimizer = tf_lossscale.LossScaleOptimizer.from_config(config)
    variable = tf.Variable([1.0])
    # A finite step, then a NaN one: the scale moves by the multiplier.
    scales = [float(optimizer.loss_scale())]
    for value in (1.0, float("nan")):
        optimizer.apply_gradients([(tf.constant([value]), variable)])
        scales.append(float(optimizer.loss_scale()))
    reference = tf.compat.v1.mixed_precision.DynamicLossScale(**rule)
    expected = [float(reference())]
    for value in (1.0, float("nan")):
        reference.update([tf.constant([value])])
        expected.append(float(reference()))
    return {
        "class": type(optimizer).__name__,
        "is_tf_keras_wrapper": isinstance(
            optimizer, keras.mixed_precision.LossScaleOptimizer),
        "inner": type(optimizer.inner_optimizer).__module__,
        "loaded": optimizer.loss_scale.get_config(),
        "written": rule,
        "scales": scales,
        "expected": expected,
    }


def bfloat16_warnings():
    """float8-bfloat16.md: both tf-keras wrappers made under tf-keras'
    `mixed_bfloat16` warn (a `UserWarning`) unless the scale is a fixed 1;
    {case: [(category name, the message names the suggested scale)]}."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    cases = {
        "new_dynamic": (keras.optimizers.SGD, "dynamic"),
        "legacy_dynamic": (keras.optimizers.legacy.SGD, "dynamic"),
        "new_fixed_1": (keras.optimizers.SGD,
                        tf_lossscale.FixedLossScale(1.0)),
        "legacy_fixed_1": (keras.optimizers.legacy.SGD,
                           tf_lossscale.FixedLossScale(1.0)),
    }
    found = {}
    try:
        for case, (inner, loss_scale) in cases.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tf_lossscale.LossScaleOptimizer(inner(0.1),
                                                loss_scale=loss_scale)
            found[case] = [
                (w.category.__name__,
                 "FixedLossScale(1, skip_non_finite=True)" in str(w.message))
                for w in caught if "bfloat16" in str(w.message)]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return found

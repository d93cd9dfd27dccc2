"""`FailureWatch` with tf-keras: a late failure named and carried on, in
`fit`; and in custom loops, with a legacy optimizer and with a
`LossScaleGroup` of two.

Not a test: `tests/watch/test_reach.py` runs `run()` and `run_loop()` in the
session's `tf_keras_interpreter` (`TF_USE_LEGACY_KERAS=1`, so `tf.keras` is
tf-keras), which answers what it found, as JSON.
"""

import numpy as np
import tensorflow as tf

import tf_lossscale
from tests.helpers import late_failures as late

keras = tf.keras


def run():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = late.logits_classifier(keras)
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.Lion(0.12)),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    x, y = late.separable_data()
    watch = tf_lossscale.FailureWatch([(x[:late.BATCH], y[:late.BATCH])],
                                      on_failure="fix", steps=1,
                                      verbose=False)
    history = watch.fit(model, x, y, batch_size=late.BATCH, epochs=22,
                        shuffle=False, verbose=0)
    # The failed model is as it was at the failure: fixed again, its
    # optimizer's state must come over whole.
    again = watch.report.fix(model)
    old, new = model.optimizer, again.optimizer
    return {
        "keras": keras.__name__,
        "callback_bases": [c.__module__ for c in type(watch).__mro__],
        "reports": len(watch.reports),
        "first_nonfinite_layer": watch.report.diagnosis.first_nonfinite_layer,
        "carried_dtype": history.model.get_layer("logits").compute_dtype,
        "losses_finite": bool(np.all(np.isfinite(history.history["loss"]))),
        "iterations": [int(old.iterations), int(new.iterations)],
        "state_equal": all(
            np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(old.inner_optimizer.variables,
                            new.inner_optimizer.variables)),
        "state_count": [len(old.inner_optimizer.variables),
                        len(new.inner_optimizer.variables)],
    }


GROWTH = 4.0  # The logits' bias, times this after each step.


def _planted_failure(optimizers):
    """A two-layer model trained in a custom loop, each of `optimizers` (one
    for every variable, or one per layer) following tf-keras' protocol,
    while its logits' bias grows GROWTH-fold a step, under a watch; returns
    the model and the watch's report."""
    model = late.two_layer_classifier(keras)
    model.compile(optimizer=optimizers[0],  # The diagnosis' loss.
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    parts = ([model.trainable_variables] if len(optimizers) == 1 else
             [model.get_layer(name).trainable_variables
              for name in ("hidden", "logits")])
    bias = model.get_layer("logits").bias
    bias.assign([1.0, -1.0])

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
            scaled = [o.get_scaled_loss(loss) for o in optimizers]
        grads = tape.gradient(scaled[0], parts)  # One scale for all.
        for optimizer, part_grads, part in zip(optimizers, grads, parts):
            optimizer.apply_gradients(zip(
                optimizer.get_unscaled_gradients(part_grads), part))
        return loss

    x, y = late.two_layer_data(8)
    watch = tf_lossscale.FailureWatch([(x, y)], steps=1, settle_steps=3,
                                      max_consecutive_skips=3, verbose=False)
    try:
        for _ in range(40):
            loss = step(x, y)
            bias.assign(bias * GROWTH)
            watch.after_step(model, loss)
    except tf_lossscale.Float16FailureError as failure:
        return model, failure.report
    raise AssertionError("no failure in 40 steps")


def _state(optimizer):
    variables = optimizer.inner_optimizer.variables
    return [np.asarray(v) for v in (
        variables() if callable(variables) else variables)]


def run_loop(kind):
    """`kind`: "legacy" (one `tf.keras.optimizers.legacy.SGD`) or "group"
    (two `tf.keras.optimizers.SGD` in one `LossScaleGroup`)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    scale = tf_lossscale.DynamicLossScale(1024.0, 1000)
    if kind == "legacy":
        optimizers = [tf_lossscale.LossScaleOptimizer(
            keras.optimizers.legacy.SGD(0.01, momentum=0.9), loss_scale=scale)]
    else:
        group = tf_lossscale.LossScaleGroup(scale)
        optimizers = [tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(0.01, momentum=0.9), loss_scale=group)
                      for _ in range(2)]
    model, report = _planted_failure(optimizers)
    if kind == "legacy":
        fixed = report.fix(model)
        carried = [fixed.optimizer]
    else:
        fixed, carried = report.fix(model, optimizers=optimizers)
    groups = {id(getattr(o.loss_scale, "group", None)) for o in carried}
    return {
        "first_nonfinite_layer": report.diagnosis.first_nonfinite_layer,
        "carried_dtype": fixed.get_layer("logits").compute_dtype,
        "classes": [type(o).__name__ for o in carried],
        "one_new_group": kind == "legacy" or (
            len(groups) == 1 and id(optimizers[0].loss_scale.group)
            not in groups),
        "scale": [float(report.settled_scale), float(carried[0].loss_scale())],
        "iterations": [[int(o.iterations) for o in optimizers],
                       [int(o.iterations) for o in carried]],
        "skipped_steps": [[int(o.skipped_steps) for o in optimizers],
                          [int(o.skipped_steps) for o in carried]],
        "state_equal": all(
            len(_state(old)) == len(_state(new)) > 1 and all(
                np.array_equal(a, b)
                for a, b in zip(_state(old), _state(new)))
            for old, new in zip(optimizers, carried)),
    }

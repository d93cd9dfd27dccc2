"""`FailureWatch` with tf-keras: a late failure named and carried on.

Not a test: `tests/watch/test_reach.py` runs `run()` in the session's
`tf_keras_interpreter` (`TF_USE_LEGACY_KERAS=1`, so `tf.keras` is tf-keras),
which answers what it found, as JSON.
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

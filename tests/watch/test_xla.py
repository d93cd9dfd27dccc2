"""`FailureWatch` over `fit` compiled with XLA, several steps per call: the
two reads after each call are what the watch needs, and the run carried on
stays compiled."""

import keras
import numpy as np
import pytest

import tf_lossscale
from tests.helpers import late_failures as late

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("watch_xla")]


def test_a_late_failure_under_xla_is_named_and_carried_on():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = late.logits_classifier(keras)
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.Lion(0.12)), loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), jit_compile=True, steps_per_execution=4)
    x, y = late.separable_data()
    watch = tf_lossscale.FailureWatch([(x[:late.BATCH], y[:late.BATCH])],
                                      on_failure="fix", steps=1,
                                      verbose=False)
    history = watch.fit(model, x, y, batch_size=late.BATCH, epochs=22,
                        shuffle=False, verbose=0)
    (report,) = watch.reports
    assert report.diagnosis.first_nonfinite_layer == "logits"
    # Noticed at the end of a call of 4 steps.
    assert report.step % 4 == 0
    fixed = history.model
    assert fixed.jit_compile is True
    assert fixed.get_layer("logits").compute_dtype == "float32"
    assert np.all(np.isfinite(history.history["loss"]))

"""What the oldest supported Keras 3 releases do differently.

The package is written against the newest Keras. Each difference of an
older supported release (down to `versions.KERAS.oldest`) that it meets
is handled here, named with the release that changed it, so that the entry
can go the day the floor moves past it:

* Keras before 3.11 passes `on_train_batch_end` the first step of an
  execution of `steps_per_execution` steps; 3.11 and later, like tf-keras,
  pass its last (`last_step_of_batch`).

Left as Keras has it: before 3.15 Keras' progress bar shows the epoch's
average of every value in the logs, `loss_scale` and `skipped_steps` too
(History, CSVLogger and TensorBoard get them as logged).
"""

import keras

from tf_lossscale._internal import versions

KERAS_SERIES = versions.release_series(keras.__version__)

# The first Keras 3 release whose batch ends name the execution's last step.
_BATCH_END_NAMES_LAST_STEP_SINCE = (3, 11)


def last_step_of_batch(callback, batch):
    """The last step (counted from 0 in the epoch) of the steps whose end
    `callback.on_train_batch_end(batch, logs)` reports.

    tf-keras and Keras 3.11 and later pass that step (Keras as the
    execution's first step plus `steps_per_execution - 1`, also for a last,
    shorter execution); Keras 3.10 passes the first step. The result stops
    at the epoch's last step when the number of steps is known.
    """
    last = batch
    if (isinstance(callback, keras.callbacks.Callback)
            and KERAS_SERIES < _BATCH_END_NAMES_LAST_STEP_SINCE):
        steps_per_execution = getattr(callback.model, "steps_per_execution",
                                      None) or 1
        last = batch + int(steps_per_execution) - 1
    steps = (callback.params or {}).get("steps")
    return min(last, steps - 1) if steps else last

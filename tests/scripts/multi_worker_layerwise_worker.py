"""A model scaled per layer trained under MultiWorkerMirroredStrategy: one
worker's part.

Not a test: each worker process of `multi_worker_job.py` calls `run` with
its strategy and `JOB`. Every worker builds the same gained model
(`tests/helpers/layerwise_models.py`: no single loss scale fits it), scales
it with `tf_lossscale.layerwise.scale_per_layer` and trains it in a custom
loop (`strategy.run` of a `tf.function` step with the Keras 3 protocol:
`scale_loss`, then `apply_gradients` with the scaled gradients). Worker
`nan_task` finds a NaN in its batch at each step in `nan_steps`. `run`
returns what the worker saw after each step:

    {"task_id": 1, "scale": [...], "factors": [[...], ...],
     "weights": [[...], ...], "skipped_steps": [...]}
"""

import numpy as np
import tensorflow as tf

from tests.helpers import layerwise_models
from tf_lossscale import layerwise

JOB = {"steps": 5, "nan_steps": [3], "nan_task": 1}


def worker_batches(task_id, job):
    """`(x, y)` of shape `[steps, BATCH, ...]` for a worker; a NaN at the
    job's steps on its `nan_task`."""
    x, y = layerwise_models.data(batches=job["steps"], seed=10 + task_id)
    shape = (job["steps"], layerwise_models.BATCH)
    x, y = x.reshape(shape + (-1,)), y.reshape(shape + (-1,))
    if task_id == job["nan_task"]:
        for step in job["nan_steps"]:
            x[step, 0, 0] = np.nan
    return x, y


def run(strategy, job):
    task_id = strategy.cluster_resolver.task_id
    global_batch = layerwise_models.BATCH * strategy.num_replicas_in_sync
    with strategy.scope():
        model = layerwise.scale_per_layer(layerwise_models.gained_model())
        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)

    def dataset_fn(input_context):
        return tf.data.Dataset.from_tensor_slices(
            worker_batches(input_context.input_pipeline_id, job))

    dataset = strategy.distribute_datasets_from_function(dataset_fn)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                tf.reduce_sum(tf.square(model(x) - y), axis=-1),
                global_batch_size=global_batch)
            scaled_loss = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(inputs):
        strategy.run(replica_step, args=inputs)

    observed = {"task_id": task_id, "scale": [], "factors": [],
                "weights": [], "skipped_steps": []}
    for inputs in dataset:
        train_step(inputs)
        observed["scale"].append(float(optimizer.loss_scale()))
        observed["factors"].append(list(model.gradient_factors().values()))
        observed["weights"].append(
            [float(v) for w in model.get_weights() for v in w.ravel()])
        observed["skipped_steps"].append(int(optimizer.skipped_steps))
    return observed

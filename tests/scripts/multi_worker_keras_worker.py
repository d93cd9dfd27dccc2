"""A tiny Keras model trained under MultiWorkerMirroredStrategy: one worker's part.

Not a test: each worker process of `multi_worker_job.py` calls `run` with
its strategy, the job and the Keras in use (Keras 3's `keras` or `tf_keras`):

    {"steps": 6, "nan_steps": [1, 4], "nan_task": 1,
     "initial_loss_scale": 4.0, "increment_period": 2}

Every worker trains the same model with a `tf_lossscale.LossScaleOptimizer`
in a custom training loop (`strategy.run` of a `tf.function` step using
`get_scaled_loss`, `get_unscaled_gradients` and `apply_gradients`). Each worker
reads its own dataset; the worker whose task id is `nan_task` finds a NaN in
its batch at each step listed in `nan_steps`, the other workers never do.
`run` returns what the worker saw after each step:

    {"task_id": 1, "num_replicas": 2, "scale": [...], "weights": [[...], ...],
     "iterations": [...], "skipped_steps": [...],
     "last_nonfinite": [[variable path, ...], ...]}

`run_group` trains the same model with two optimizers in one
`tf_lossscale.LossScaleGroup`, one per layer, each scaling the same loss; the
NaN of worker `nan_task` is planted in the second optimizer's gradients only
(the data are finite). It steps them inside a `group.iteration()` block and
returns per step the scale, each optimizer's skipped steps and the weights,
with the all-reduce ops a traced step holds at its top level (the
agreements; the gradients' own all-reduces are inside the branches that
apply).

The data and the initial weights come from functions here that the tests also
import, to replay the job in one process.
"""

import numpy as np
import tensorflow as tf

import tf_lossscale

NUM_FEATURES = 3
LOCAL_BATCH_SIZE = 4


def worker_batches(task_id, job):
    """`(x, y)` arrays of shape `[steps, LOCAL_BATCH_SIZE, ...]` for a worker.

    Finite except at `job["nan_steps"]` on worker `job["nan_task"]`.
    """
    rng = np.random.default_rng(100 + task_id)
    x = rng.normal(size=(job["steps"], LOCAL_BATCH_SIZE, NUM_FEATURES))
    y = rng.normal(size=(job["steps"], LOCAL_BATCH_SIZE, 1))
    if task_id == job["nan_task"]:
        for step in job["nan_steps"]:
            x[step, 1, 0] = np.nan
    return x.astype(np.float32), y.astype(np.float32)


def build_model(keras):
    """The model with fixed initial weights, the same in every process."""
    model = keras.Sequential([
        keras.Input((NUM_FEATURES,)),
        keras.layers.Dense(2),
        keras.layers.Dense(1),
    ])
    rng = np.random.default_rng(7)
    model.set_weights([rng.normal(size=w.shape).astype(np.float32)
                       for w in model.get_weights()])
    return model


def make_inner_optimizer(keras):
    # Momentum slots make a wrongly applied skipped step visible in every
    # later step, not only in the step itself.
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def per_example_loss(model, x, y):
    return tf.reduce_sum(tf.square(model(x) - y), axis=-1)


def run(strategy, job, keras):
    """Trains the job's model on this worker; returns what it saw."""
    task_id = strategy.cluster_resolver.task_id
    global_batch_size = LOCAL_BATCH_SIZE * strategy.num_replicas_in_sync

    with strategy.scope():
        model = build_model(keras)
        optimizer = tf_lossscale.LossScaleOptimizer(
            make_inner_optimizer(keras),
            loss_scale=tf_lossscale.DynamicLossScale(
                job["initial_loss_scale"], job["increment_period"]))
        optimizer.build(model.trainable_variables)

    def dataset_fn(input_context):
        x, y = worker_batches(input_context.input_pipeline_id, job)
        return tf.data.Dataset.from_tensor_slices((x, y))

    dataset = strategy.distribute_datasets_from_function(dataset_fn)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                per_example_loss(model, x, y),
                global_batch_size=global_batch_size)
            scaled_loss = optimizer.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = optimizer.get_unscaled_gradients(scaled_grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def train_step(inputs):
        strategy.run(replica_step, args=inputs)

    observed = {
        "task_id": task_id,
        "num_replicas": strategy.num_replicas_in_sync,
        "scale": [], "weights": [], "iterations": [], "skipped_steps": [],
        "last_nonfinite": [],
    }
    for inputs in dataset:
        train_step(inputs)
        observed["scale"].append(float(optimizer.loss_scale()))
        observed["weights"].append(
            [float(v) for w in model.get_weights() for v in w.ravel()])
        observed["iterations"].append(int(optimizer.iterations.numpy()))
        observed["skipped_steps"].append(int(optimizer.skipped_steps))
        observed["last_nonfinite"].append(
            optimizer.last_nonfinite_variables())
    return observed


def layer_variables(model):
    """Each optimizer's variables in `run_group`: one layer each."""
    return [list(layer.trainable_variables) for layer in model.layers]


def poison_and_finite_batches(task_id, job):
    """`worker_batches` with the NaN taken out of the data, and per step the
    value planted in the second optimizer's gradients instead (NaN or 0)."""
    x, y = worker_batches(task_id, job)
    poison = np.where(np.isnan(x).any(axis=(1, 2)), np.nan, 0.0)
    return np.nan_to_num(x), y, poison.astype(np.float32)


def run_group(strategy, job, keras):
    """Trains the job's model with a `LossScaleGroup` of two optimizers,
    stepped in one `group.iteration()` block."""
    task_id = strategy.cluster_resolver.task_id
    global_batch_size = LOCAL_BATCH_SIZE * strategy.num_replicas_in_sync

    with strategy.scope():
        model = build_model(keras)
        group = tf_lossscale.LossScaleGroup(tf_lossscale.DynamicLossScale(
            job["initial_loss_scale"], job["increment_period"]))
        optimizers = [tf_lossscale.LossScaleOptimizer(
            make_inner_optimizer(keras), loss_scale=group) for _ in range(2)]
        parts = layer_variables(model)
        for optimizer, variables in zip(optimizers, parts):
            optimizer.build(variables)

    def dataset_fn(input_context):
        x, y, poison = poison_and_finite_batches(
            input_context.input_pipeline_id, job)
        return tf.data.Dataset.from_tensor_slices((x, y, poison))

    dataset = strategy.distribute_datasets_from_function(dataset_fn)

    def replica_step(x, y, poison):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.nn.compute_average_loss(
                per_example_loss(model, x, y),
                global_batch_size=global_batch_size)
            scaled = [optimizer.scale_loss(loss) for optimizer in optimizers]
        grads = [tape.gradient(s, v) for s, v in zip(scaled, parts)]
        grads[1] = [g + poison for g in grads[1]]
        with group.iteration():
            for optimizer, g, v in zip(optimizers, grads, parts):
                optimizer.apply_gradients(zip(g, v))

    @tf.function
    def train_step(inputs):
        strategy.run(replica_step, args=inputs)

    observed = {"task_id": task_id, "scale": [], "weights": [],
                "skipped_steps": []}
    for inputs in dataset:
        train_step(inputs)
        observed["scale"].append(float(group()))
        observed["weights"].append(
            [float(v) for w in model.get_weights() for v in w.ravel()])
        observed["skipped_steps"].append(
            [int(optimizer.skipped_steps) for optimizer in optimizers])
    observed["collectives"] = collective_ops(train_step, inputs)

    # The same step with the inner optimizers alone, unscaled: the
    # gradients' own all-reduces, which the group's step must not add to.
    with strategy.scope():
        plain = [make_inner_optimizer(keras) for _ in range(2)]
        for optimizer, variables in zip(plain, parts):
            optimizer.build(variables)

    def plain_replica_step(x, y, poison):
        del poison
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                per_example_loss(model, x, y),
                global_batch_size=global_batch_size)
        grads = tape.gradient(loss, parts)
        for optimizer, g, v in zip(plain, grads, parts):
            optimizer.apply_gradients(zip(g, v))

    @tf.function
    def plain_step(inputs):
        strategy.run(plain_replica_step, args=inputs)

    observed["plain_collectives"] = collective_ops(plain_step, inputs)
    return observed


def collective_ops(step, inputs):
    """The collective ops of `step` traced for `inputs`: in its graph and in
    every function it calls, both branches of each `cond` included."""
    graph_def = step.get_concrete_function(inputs).graph.as_graph_def()
    nodes = [*graph_def.node, *(node for function in graph_def.library.function
                                for node in function.node_def)]
    return sum(1 for node in nodes if node.op.startswith("Collective"))

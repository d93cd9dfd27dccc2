"""A watched float16 run that fails late under MultiWorkerMirroredStrategy:
one worker's part.

Not a test: each worker process of `multi_worker_job.py` calls `run` with
its strategy and `JOB`. Every worker builds the same tiny classifier under
the global mixed_float16 policy, trains it in a custom loop and calls
`FailureWatch.after_step` after each step. The logits layer's bias is
multiplied by `JOB["growth"]` after each step (a planted growth, the same
on every worker: it is the variable's own value), so its float16 outputs
overflow after a few steps. Each worker's watch saves to a directory of its
own (under the job's folder), so the test can see which one wrote.
After the failure, `report.fix(model)` carries the run on for
`JOB["steps_after"]` more steps. `run` returns:

    {"task_id": 1, "step": 9, "reason": "...", "cause": "...",
     "first_nonfinite_layer": "logits", "scale": [...],
     "skipped_steps": [...], "wrote": ["report.json", ...],
     "fixed_dtype": "float32", "losses_after": [...],
     "skipped_after": [...], "iterations": [at the failure, at the end],
     "weights_after": [...]}
"""

import itertools
import os

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale

JOB = {"max_steps": 40, "growth": 4.0, "steps_after": 4}
FEATURES, LOCAL_BATCH = 4, 4


def batches(task_id):
    """This worker's `(x, y)`, one batch, repeated every step."""
    rng = np.random.default_rng(20 + task_id)
    x = rng.standard_normal((LOCAL_BATCH, FEATURES)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _build(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(h))
        model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
            keras.optimizers.SGD(0.01, momentum=0.9),
            loss_scale=tf_lossscale.DynamicLossScale(1024.0, 1000)),
            # The diagnosis' loss; the loop computes its own.
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True))
        model.optimizer.build(model.trainable_variables)
    # Weights alike on both workers (the seed), a bias that can grow.
    model.get_layer("logits").bias.assign([1.0, -1.0])
    return model


def _step_function(strategy, model):
    optimizer = model.optimizer
    global_batch = LOCAL_BATCH * strategy.num_replicas_in_sync

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                keras.losses.sparse_categorical_crossentropy(
                    y, model(x, training=True), from_logits=True),
                global_batch_size=global_batch)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(inputs):
        losses = strategy.run(replica_step, args=inputs)
        return strategy.reduce("SUM", losses, axis=None)

    return step


def run(strategy, job):
    task_id = strategy.cluster_resolver.task_id
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return _run(strategy, job, task_id)
    finally:
        keras.mixed_precision.set_global_policy(policy)


def _run(strategy, job, task_id):
    model = _build(strategy)
    dataset = strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensors(
            batches(context.input_pipeline_id)).repeat())
    # The diagnosis splits each batch over the replicas: the global batch,
    # the same on every worker.
    parts = [batches(task) for task in range(strategy.num_replicas_in_sync)]
    diagnosed = [tuple(np.concatenate(part) for part in zip(*parts))]
    directory = os.path.join(os.getcwd(), f"watch_worker{task_id}")
    watch = tf_lossscale.FailureWatch(
        diagnosed, on_failure="stop", steps=1, directory=directory,
        log_dir=os.path.join(directory, "logs"), settle_steps=3,
        max_consecutive_skips=3, verbose=False)
    step = _step_function(strategy, model)
    bias = model.get_layer("logits").bias
    observed = {"task_id": task_id, "scale": [], "skipped_steps": []}
    report = None
    for inputs in itertools.islice(iter(dataset), job["max_steps"]):
        loss = step(inputs)
        bias.assign(bias * job["growth"])
        observed["scale"].append(float(model.optimizer.loss_scale()))
        observed["skipped_steps"].append(int(model.optimizer.skipped_steps))
        report = watch.after_step(model, loss)
        if report is not None:
            break
    if report is None:
        raise AssertionError(f"no failure in {job['max_steps']} steps: "
                             f"{observed}")
    observed.update(
        step=report.step, reason=report.reason, cause=report.cause,
        first_nonfinite_layer=report.diagnosis.first_nonfinite_layer,
        wrote=sorted(os.listdir(directory)) if os.path.isdir(directory)
        else [])
    fixed = report.fix(model)
    observed["fixed_dtype"] = fixed.get_layer("logits").compute_dtype
    step = _step_function(strategy, fixed)
    observed["losses_after"], observed["skipped_after"] = [], []
    for inputs in itertools.islice(iter(dataset), job["steps_after"]):
        observed["losses_after"].append(float(step(inputs)))
        observed["skipped_after"].append(int(fixed.optimizer.skipped_steps))
    observed["iterations"] = [
        int(np.asarray(optimizer.iterations))
        for optimizer in (model.optimizer, fixed.optimizer)]
    observed["weights_after"] = [float(v) for w in fixed.get_weights()
                                 for v in np.ravel(w)]
    return observed

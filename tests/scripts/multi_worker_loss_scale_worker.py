"""A loss scale driven under MultiWorkerMirroredStrategy: one worker's part.

Not a test: each worker process of `multi_worker_job.py` calls `run` with
its strategy and the job, `make_job()` (JSON, as every process gets it):

    {"initial_loss_scale": 8.0, "increment_period": 3, "multiplier": 2.0,
     "poison": [[0.0, NaN], [0.0, 0.0], ...],
     "contexts": ["replica", "cross_replica"], "failure": {...}}

`poison[step][replica]` is added to one of that replica's gradients in that
step: 0.0 keeps the step finite, NaN, Infinity or -Infinity make it non-finite
on that replica only (Python's `json` reads and writes these spellings).

An optional key "failure": {"loss_scale": {DynamicLossScale kwargs},
"poison": [...]} runs last: a loss scale whose policy makes some step fail.
The worker then reports one more observation, "context": "failure", the scale
after each step that passed, the step that failed (or null), the error's
type and message, and the local copies of every state variable afterwards.

For each context the worker creates a fresh `DynamicLossScale` under the
strategy's scope, runs every step in a `tf.function` and reports:

    {"task_id": 1, "context": "replica", "num_replicas": 2,
     "scale": [...], "should_apply": [...], "replica_should_apply": [[...]],
     "replica_scale_reads": [[...], ...], "variable_values": [[...], ...],
     "collective_reductions_per_step": 1}

Per step, `scale` and `should_apply` are what this worker saw;
`replica_should_apply` and `replica_scale_reads` hold the decision and the
scale as received inside `strategy.run` by each local replica, and
`variable_values` each local copy of the scale variable, so a test can check
that nothing diverges. `collective_reductions_per_step` counts the all-reduce
ops in the traced step function. The test compares the observations of all
workers with each other and with a single-process computation.
"""

import numpy as np
import tensorflow as tf

import tf_lossscale

NUM_WORKERS = 2
POISONED_WORKER = 1
CONTEXTS = ("replica", "cross_replica")
# Only worker 1 overflows. With a hysteresis of 2 the scale backs off from
# 4 to 2 to 1 on steps 2 and 3; step 4 is a back-off at the floor.
FAILURE = {
    "loss_scale": {"initial_loss_scale": 4.0, "increment_period": 2,
                   "hysteresis": 2, "on_min_loss_scale": "raise"},
    "poison": [[0.0, float("nan")], [0.0, 0.0]] + [[0.0, float("nan")]] * 5,
}


def worker_1_poison_schedule(num_steps=150, seed=0):
    """Per step and worker, the value added to a gradient; 0 is finite.

    Worker 0 is always finite. Worker 1 meets NaN, +Inf and -Inf at random,
    sometimes several steps in a row (down to the floor of 1), between runs of
    finite steps long enough for the scale to grow.
    """
    rng = np.random.RandomState(seed)
    kinds = [float("nan"), float("inf"), float("-inf")]
    rows = []
    while len(rows) < num_steps:
        rows.extend([[0.0] * NUM_WORKERS] * rng.randint(0, 10))
        for _ in range(rng.randint(1, 4)):
            row = [0.0] * NUM_WORKERS
            row[POISONED_WORKER] = kinds[rng.randint(len(kinds))]
            rows.append(row)
    return rows[:num_steps]


def make_job():
    return {"initial_loss_scale": 8.0, "increment_period": 3,
            "multiplier": 2.0, "contexts": list(CONTEXTS),
            "poison": worker_1_poison_schedule(), "failure": FAILURE}


def gradients_for(poison, step, replica):
    """The gradients of `replica` in `step`, made non-finite by its poison.

    Tests import this to feed a single-device loss scale the same gradients.
    """
    bad = poison[step, replica]
    # Alternate which gradient carries the poison so the check has to look
    # at all of them, not just the first.
    first = tf.fill([3], 1.0) + tf.where(step % 2 == 0, bad, 0.0)
    second = tf.fill([2, 2], 0.5) + tf.where(step % 2 == 1, bad, 0.0)
    return [first, None, second]


def replica_gradients(poison, step):
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return gradients_for(poison, step, replica)


def count_collective_reductions(concrete_function):
    """All-reduce ops across workers in a traced step."""
    return sum(1 for op in concrete_function.graph.get_operations()
               if op.type.startswith("CollectiveReduce"))


def run_context(strategy, job, context):
    """Runs all steps in `context` and returns this worker's observations."""
    poison = tf.constant(job["poison"], tf.float32)
    with strategy.scope():
        loss_scale = tf_lossscale.DynamicLossScale(
            job["initial_loss_scale"], job["increment_period"],
            job["multiplier"])
    scale_variable, = [v for v in loss_scale.variables
                       if "current_loss_scale" in v.name]

    def update_in_replica(step):
        _, should_apply = loss_scale.update(replica_gradients(poison, step))
        # tf.identity gives each replica its own output, so the results show
        # what every replica received rather than one shared tensor.
        return tf.identity(should_apply), tf.identity(loss_scale())

    @tf.function
    def replica_step(step):
        return strategy.run(update_in_replica, args=(step,))

    @tf.function
    def cross_replica_step(step):
        # Cross-replica context means inside the scope: outside it there is
        # no strategy to combine the workers' verdicts with.
        with strategy.scope():
            grads = strategy.run(replica_gradients, args=(poison, step))
            _, should_apply = loss_scale.update(grads)
            with tf.control_dependencies([should_apply]):
                reads = strategy.run(lambda: tf.identity(loss_scale()))
        return should_apply, reads

    step_fn = replica_step if context == "replica" else cross_replica_step
    observed = {
        "task_id": strategy.cluster_resolver.task_id,
        "context": context,
        "num_replicas": strategy.num_replicas_in_sync,
        "scale": [], "should_apply": [], "replica_should_apply": [],
        "replica_scale_reads": [], "variable_values": [],
    }
    for step in range(len(job["poison"])):
        should_apply, reads = step_fn(tf.constant(step))
        local_should_apply = [
            bool(s) for s in strategy.experimental_local_results(should_apply)]
        observed["should_apply"].append(local_should_apply[0])
        observed["replica_should_apply"].append(local_should_apply)
        observed["scale"].append(float(loss_scale()))
        observed["replica_scale_reads"].append(
            [float(r) for r in strategy.experimental_local_results(reads)])
        observed["variable_values"].append(
            [float(v) for v in
             strategy.experimental_local_results(scale_variable)])
    observed["collective_reductions_per_step"] = count_collective_reductions(
        step_fn.get_concrete_function(tf.constant(0)))
    return observed


def run_failure(strategy, spec):
    """Steps a failing loss scale until its step fails; returns what it saw."""
    poison = tf.constant(spec["poison"], tf.float32)
    with strategy.scope():
        loss_scale = tf_lossscale.DynamicLossScale(**spec["loss_scale"])

    def update_in_replica(step):
        _, should_apply = loss_scale.update(replica_gradients(poison, step))
        return tf.identity(should_apply)

    @tf.function
    def step_fn(step):
        return strategy.run(update_in_replica, args=(step,))

    observed = {"task_id": strategy.cluster_resolver.task_id,
                "context": "failure", "scale": [], "failed_at_step": None,
                "error_type": None, "error": None}
    for step in range(len(spec["poison"])):
        try:
            step_fn(tf.constant(step))
        except tf.errors.OpError as error:
            observed["failed_at_step"] = step
            observed["error_type"] = type(error).__name__
            observed["error"] = error.message[-1000:]
            break
        observed["scale"].append(float(loss_scale()))
    observed["state"] = {
        variable.name.split(":")[0]: [
            v.numpy().item()
            for v in strategy.experimental_local_results(variable)]
        for variable in loss_scale.variables}
    return observed


def run(strategy, job):
    """This worker's observations: one per context, then the failure's."""
    return [run_context(strategy, job, context)
            for context in job["contexts"]] + (
                [run_failure(strategy, job["failure"])]
                if "failure" in job else [])

"""A MultiWorkerMirroredStrategy job on two local worker processes.

`run(scenarios, folder)` starts this file twice as a script, with `TF_CONFIG`
for 127.0.0.1; each worker creates one strategy and runs the scenarios named
in turn, in the same order, reporting each as one JSON line. So one pair of
processes (one TensorFlow import each) serves every multi-worker test:

- "keras_3", "tf_keras": the Keras 3 and the tf-keras (`tf_keras` imported
  directly) wrapper in a custom loop (`multi_worker_keras_worker.py`, `JOB`);
- "loss_scale": a `DynamicLossScale` alone
  (`multi_worker_loss_scale_worker.py`);
- "keras_3_group": two Keras 3 optimizers in one `LossScaleGroup`, stepped
  in a `group.iteration()` block: one agreement across the workers for both
  (`run_group`; the steps of a group outside a block agree as a single
  optimizer's do, and `skip="together"` differs only on the host);
- "layerwise": a model scaled per layer in a custom loop
  (`multi_worker_layerwise_worker.py`);
- "watch": a float16 run that fails late, watched by `FailureWatch` in a
  custom loop and carried on (`multi_worker_watch_worker.py`).

A scenario that raises is reported as its traceback and ends its worker,
and a worker that dies or hangs ends the job (its peer would wait in a
collective for it): the scenarios left are reported as not run.
`reference_scale_trace` and `single_process_weights` replay `JOB` with
TensorFlow's own DynamicLossScale and on one device.
"""

import json
import os
import socket
import subprocess
import sys
import time
import traceback

import numpy as np
import tensorflow as tf

from tests.scripts import multi_worker_keras_worker as keras_worker
from tests.scripts import multi_worker_layerwise_worker as layerwise_worker
from tests.scripts import multi_worker_loss_scale_worker as loss_scale_worker
from tests.scripts import multi_worker_watch_worker as watch_worker
from tests.helpers import reference_oracle
from tests.helpers import subprocesses

NUM_WORKERS = 2
# A bound for a hung job (a worker waiting for a dead peer), not a speed
# requirement: the job takes seconds on a quiet machine, but one tf-keras
# scenario alone passed 120 s on 2 cores at load 8.
_TIMEOUT_SECONDS = 900
_STDERR_TAIL_CHARS = 6000
JOB = {
    "steps": 6,
    "nan_steps": [1, 4],
    "nan_task": 1,
    "initial_loss_scale": 4.0,
    "increment_period": 2,
}


def _keras_3():
    import keras  # pylint: disable=g-import-not-at-top
    return keras


def _tf_keras():
    import tf_keras  # pylint: disable=g-import-not-at-top
    return tf_keras


SCENARIOS = {
    "keras_3": lambda strategy: keras_worker.run(strategy, JOB, _keras_3()),
    "tf_keras": lambda strategy: keras_worker.run(strategy, JOB, _tf_keras()),
    "loss_scale": lambda strategy: loss_scale_worker.run(
        strategy, loss_scale_worker.make_job()),
    "keras_3_group": lambda strategy: keras_worker.run_group(
        strategy, JOB, _keras_3()),
    "layerwise": lambda strategy: layerwise_worker.run(
        strategy, layerwise_worker.JOB),
    "watch": lambda strategy: watch_worker.run(strategy, watch_worker.JOB),
}


def reports(results, scenario):
    """Both workers' reports of `scenario` in `run`'s `results`; fails the
    test with a worker's traceback if the scenario raised there."""
    assert scenario in results, f"{scenario} did not run: {results}"
    for answer in results[scenario]:
        assert "error" not in answer, answer["error"]
    return [answer["report"] for answer in results[scenario]]


def run(scenarios, folder):
    """Runs `scenarios` (names of SCENARIOS) on two local workers writing
    their output into `folder`; returns {scenario: [worker 0's answer,
    worker 1's]}, an answer being {"report": ...} or {"error": ...}.

    No worker outlives this call, nor runs longer than _TIMEOUT_SECONDS.
    """
    cluster = {"worker": [f"127.0.0.1:{port}"
                          for port in _free_ports(NUM_WORKERS)]}
    outputs = [os.path.join(folder, f"worker{task_id}.out")
               for task_id in range(NUM_WORKERS)]
    errors = [os.path.join(folder, f"worker{task_id}.err")
              for task_id in range(NUM_WORKERS)]
    processes = []
    try:
        for task_id in range(NUM_WORKERS):
            env = subprocesses.environment(TF_CONFIG=json.dumps({
                "cluster": cluster,
                "task": {"type": "worker", "index": task_id}}))
            with open(outputs[task_id], "w") as out, \
                    open(errors[task_id], "w") as err:
                processes.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__),
                     json.dumps(list(scenarios))],
                    env=env, cwd=folder, stdout=out, stderr=err))
        _wait_for_all_or_the_first_failure(processes)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    ended = (f"the worker ended before reporting it (exit codes "
             f"{[p.returncode for p in processes]}; negative: killed after "
             f"{_TIMEOUT_SECONDS} s or after the other's failure)\n"
             f"{_stderr_tails(errors)}")
    results = {scenario: [{"error": ended}] * NUM_WORKERS
               for scenario in scenarios}
    for task_id, path in enumerate(outputs):
        with open(path) as f:
            for line in f:
                if line.startswith("{"):
                    answer = json.loads(line)
                    results[answer.pop("scenario")][task_id] = answer
    return results


def _free_ports(count):
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _wait_for_all_or_the_first_failure(processes):
    deadline = time.monotonic() + _TIMEOUT_SECONDS
    # A worker that dies leaves its peer waiting in a collective, so stop at
    # the first failure instead of waiting for the deadline.
    while (any(p.poll() is None for p in processes)
           and not any(p.poll() for p in processes)
           and time.monotonic() < deadline):
        time.sleep(0.2)
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def _stderr_tails(paths):
    tails = []
    for task_id, path in enumerate(paths):
        with open(path, errors="replace") as f:
            tails.append(f"--- worker {task_id} stderr (tail) ---\n"
                         f"{f.read()[-_STDERR_TAIL_CHARS:]}")
    return "\n".join(tails)


def reference_scale_trace(job):
    """Scale after each step, from TensorFlow's own DynamicLossScale."""
    return reference_oracle.reference_scales(
        [step not in job["nan_steps"] for step in range(job["steps"])],
        initial_loss_scale=job["initial_loss_scale"],
        increment_period=job["increment_period"], multiplier=2.0)


def single_process_weights(job, keras):
    """Weights after each step of the same job trained on one device (with
    `keras`, Keras 3 or tf_keras).

    The global batch is both workers' batches; the NaN steps are simply left
    out, which is what skipping them must amount to.
    """
    model = keras_worker.build_model(keras)
    optimizer = keras_worker.make_inner_optimizer(keras)
    batches = [keras_worker.worker_batches(task_id, job)
               for task_id in range(NUM_WORKERS)]
    trace = []
    for step in range(job["steps"]):
        if step not in job["nan_steps"]:
            x = np.concatenate([x[step] for x, _ in batches])
            y = np.concatenate([y[step] for _, y in batches])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    keras_worker.per_example_loss(model, x, y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        trace.append(np.concatenate([w.ravel() for w in model.get_weights()]))
    return np.array(trace)


def single_process_group_weights(job, keras):
    """Weights after each step of `run_group`'s job on one device: the
    second optimizer's step left out where worker `nan_task` planted its
    NaN."""
    model = keras_worker.build_model(keras)
    parts = keras_worker.layer_variables(model)
    optimizers = [keras_worker.make_inner_optimizer(keras) for _ in parts]
    batches = [keras_worker.poison_and_finite_batches(task_id, job)
               for task_id in range(NUM_WORKERS)]
    trace = []
    for step in range(job["steps"]):
        poisoned = any(np.isnan(poison[step]) for _, _, poison in batches)
        x = np.concatenate([x[step] for x, _, _ in batches])
        y = np.concatenate([y[step] for _, y, _ in batches])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras_worker.per_example_loss(model, x, y))
        grads = tape.gradient(loss, parts)
        for index, (optimizer, g, v) in enumerate(zip(optimizers, grads,
                                                      parts)):
            if poisoned and index == 1:
                continue
            optimizer.apply_gradients(zip(g, v))
        trace.append(np.concatenate([w.ravel() for w in model.get_weights()]))
    return np.array(trace)


def _worker_main(scenarios):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    for scenario in scenarios:
        try:
            answer = {"report": SCENARIOS[scenario](strategy)}
        except Exception:  # pylint: disable=broad-except
            answer = {"error": traceback.format_exc()}
        print(json.dumps(dict(answer, scenario=scenario)), flush=True)
        if "error" in answer:
            sys.exit(1)


if __name__ == "__main__":
    _worker_main(json.loads(sys.argv[1]))

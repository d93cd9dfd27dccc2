"""A MultiWorkerMirroredStrategy job on two local worker processes.

Not a test: the helpers that `test_keras_multi_worker.py` (Keras 3) and
`test_tf_keras_multi_worker.py` (tf-keras, `TF_USE_LEGACY_KERAS=1` in the
workers' environment) share. `run_workers` starts `multi_worker_keras_worker.py`
twice with `TF_CONFIG` for 127.0.0.1 and returns the workers' JSON reports;
`reference_scale_trace` and `single_process_weights` replay the job with
TensorFlow's own DynamicLossScale and on one device.
"""

import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tf_lossscale

from tests.support import multi_worker_keras_worker as worker
from tests.support import reference_oracle

NUM_WORKERS = 2
# A bound for a hung job (a worker waiting for a dead peer), not a speed
# requirement: the job takes seconds on a quiet machine, but a tf-keras
# job passed 120 s on 2 cores at load 8.
_TIMEOUT_SECONDS = 300
JOB = {
    "steps": 6,
    "nan_steps": [1, 4],
    "nan_task": 1,
    "initial_loss_scale": 4.0,
    "increment_period": 2,
}


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


def _worker_env(cluster, task_id, extra_env):
    env = dict(os.environ, **extra_env)
    env["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": task_id}})
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # The workers must import the tf_lossscale under test (e.g. from Bazel's
    # runfiles), not whatever else the interpreter would find.
    package_root = os.path.dirname(os.path.dirname(tf_lossscale.__file__))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def run_workers(job, tmp_path, extra_env=None):
    """Runs the job on two local workers (with `extra_env` added to their
    environment); returns their JSON reports."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "multi_worker_keras_worker.py")
    cluster = {"worker": [f"127.0.0.1:{port}"
                          for port in _free_ports(NUM_WORKERS)]}
    processes, logs = [], []
    try:
        for task_id in range(NUM_WORKERS):
            stdout = open(tmp_path / f"worker{task_id}.out", "w+")
            stderr = open(tmp_path / f"worker{task_id}.err", "w+")
            logs.append((stdout, stderr))
            processes.append(subprocess.Popen(
                [sys.executable, script, json.dumps(job)],
                env=_worker_env(cluster, task_id, extra_env or {}),
                stdout=stdout, stderr=stderr))
        deadline = time.monotonic() + _TIMEOUT_SECONDS
        failures = []
        for task_id, process in enumerate(processes):
            try:
                returncode = process.wait(
                    timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                returncode = f"no result after {_TIMEOUT_SECONDS} s"
            if returncode != 0:
                failures.append((task_id, returncode))
        if failures:
            details = []
            for task_id, returncode in failures:
                stderr = logs[task_id][1]
                stderr.seek(0)
                details.append(f"--- worker {task_id} ({returncode}):\n"
                               f"{stderr.read()[-6000:]}")
            raise AssertionError("workers failed:\n" + "\n".join(details))
        reports = []
        for stdout, _ in logs:
            stdout.seek(0)
            reports.append(json.loads(stdout.read().strip().splitlines()[-1]))
        return reports
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for stdout, stderr in logs:
            stdout.close()
            stderr.close()


def reference_scale_trace(job):
    """Scale after each step, from TensorFlow's own DynamicLossScale."""
    return reference_oracle.reference_scales(
        [step not in job["nan_steps"] for step in range(job["steps"])],
        initial_loss_scale=job["initial_loss_scale"],
        increment_period=job["increment_period"], multiplier=2.0)


def single_process_weights(job, keras_module=keras):
    """Weights after each step of the same job trained on one device (with
    `keras_module`, Keras 3 or tf_keras).

    The global batch is both workers' batches; the NaN steps are simply left
    out, which is what skipping them must amount to.
    """
    model = worker.build_model(keras_module)
    optimizer = worker.make_inner_optimizer(keras_module)
    batches = [worker.worker_batches(task_id, job)
               for task_id in range(NUM_WORKERS)]
    trace = []
    for step in range(job["steps"]):
        if step not in job["nan_steps"]:
            x = np.concatenate([x[step] for x, _ in batches])
            y = np.concatenate([y[step] for _, y in batches])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(worker.per_example_loss(model, x, y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        trace.append(np.concatenate([w.ravel() for w in model.get_weights()]))
    return np.array(trace)

"""DynamicLossScale across real worker processes.

Two processes on 127.0.0.1 form a `MultiWorkerMirroredStrategy` cluster and run
`multi_worker_loss_scale_worker.py`; only worker 1 sees non-finite gradients.
If the workers decided separately, worker 0 would apply a step that worker 1
skips and the next gradient all-reduce would wait for a peer that never joins.
The tests pin down that both workers print the same trace, and that it is the
trace of the single-device algorithm fed both workers' gradients. The same
job then runs a loss scale with on_min_loss_scale="raise" into its floor:
both workers must fail on the same step with the same error (a worker that
failed alone would leave its peer hanging in the next all-reduce).

Parameter-server training cannot wait for such a shared verdict; a separate
process checks that it is refused with a clear error.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.support import dynamic_rule_model
from tests.support import multi_worker_loss_scale_worker as worker_program
from tests.support import paths

NUM_WORKERS = 2
POISONED_WORKER = 1
WORKER_SCRIPT = paths.script("multi_worker_loss_scale_worker.py")
# Generous: the workers usually finish in seconds, but the machine is shared.
WORKER_TIMEOUT_SECONDS = 300
STDERR_TAIL_CHARS = 4000

CONTEXTS = ("replica", "cross_replica")
JOB = {"initial_loss_scale": 8.0, "increment_period": 3, "multiplier": 2.0,
       "contexts": list(CONTEXTS)}
_NAN = float("nan")
# Only worker 1 overflows. With a hysteresis of 2 the scale backs off from
# 4 to 2 to 1 on steps 2 and 3; step 4 is a back-off at the floor.
FAILURE = {
    "loss_scale": {"initial_loss_scale": 4.0, "increment_period": 2,
                   "hysteresis": 2, "on_min_loss_scale": "raise"},
    "poison": [[0.0, _NAN], [0.0, 0.0]] + [[0.0, _NAN]] * 5,
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


def free_port():
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stderr_tails(stderr_paths):
    tails = []
    for task_id, path in enumerate(stderr_paths):
        with open(path, errors="replace") as f:
            tails.append(f"--- worker {task_id} stderr (tail) ---\n"
                         f"{f.read()[-STDERR_TAIL_CHARS:]}")
    return "\n".join(tails)


def run_workers(job):
    """Runs one process per worker; returns each worker's JSON lines.

    Fails the test, with the workers' stderr, if a worker exits with an error
    or the job exceeds WORKER_TIMEOUT_SECONDS; no worker outlives this call.
    """
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(NUM_WORKERS)]
    with tempfile.TemporaryDirectory(prefix="tf_lossscale_workers_") as tmp:
        stdout_paths = [os.path.join(tmp, f"worker_{i}.out")
                        for i in range(NUM_WORKERS)]
        stderr_paths = [os.path.join(tmp, f"worker_{i}.err")
                        for i in range(NUM_WORKERS)]
        processes = []
        try:
            for task_id in range(NUM_WORKERS):
                env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                           TF_CONFIG=json.dumps({
                               "cluster": {"worker": addresses},
                               "task": {"type": "worker", "index": task_id},
                           }))
                with open(stdout_paths[task_id], "w") as out, \
                        open(stderr_paths[task_id], "w") as err:
                    processes.append(subprocess.Popen(
                        [sys.executable, WORKER_SCRIPT, json.dumps(job)],
                        stdout=out, stderr=err, env=env, cwd=tmp))
            deadline = time.monotonic() + WORKER_TIMEOUT_SECONDS
            # A worker that dies leaves its peer waiting in a collective, so
            # stop at the first failure instead of waiting for the deadline.
            while (any(p.poll() is None for p in processes)
                   and not any(p.poll() for p in processes)
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            if any(p.poll() is None for p in processes) or any(
                    p.returncode for p in processes):
                for process in processes:
                    if process.poll() is None:
                        process.kill()
                    process.wait()
                pytest.fail(
                    "workers did not all finish successfully (exit codes "
                    f"{[p.returncode for p in processes]}; negative: killed "
                    f"after {WORKER_TIMEOUT_SECONDS} s or by the first "
                    f"failure)\n{stderr_tails(stderr_paths)}")
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()
        outputs = []
        for path in stdout_paths:
            with open(path) as f:
                outputs.append([json.loads(line) for line in f
                                if line.startswith("{")])
        expected_lines = len(job["contexts"]) + ("failure" in job)
        if any(len(lines) != expected_lines for lines in outputs):
            pytest.fail(f"expected one JSON line per context, got {outputs}\n"
                        f"{stderr_tails(stderr_paths)}")
    return outputs


@pytest.fixture(scope="module")
def worker_traces():
    """{context: [worker 0's observations, worker 1's observations]}."""
    job = dict(JOB, poison=worker_1_poison_schedule(), failure=FAILURE)
    outputs = run_workers(job)
    traces = {}
    for task_id, lines in enumerate(outputs):
        for observed in lines:
            assert observed["task_id"] == task_id
            traces.setdefault(observed["context"], []).append(observed)
    return job, traces


@pytest.fixture(scope="module")
def single_device_trace(worker_traces):
    """TensorFlow's reference on one device, fed both workers' gradients."""
    job, _ = worker_traces
    poison = tf.constant(job["poison"], tf.float32)
    num_steps, num_replicas = poison.shape
    reference = tf.compat.v1.mixed_precision.DynamicLossScale(
        job["initial_loss_scale"], job["increment_period"], job["multiplier"])

    @tf.function
    def run_all():
        scales = tf.TensorArray(tf.float32, num_steps)
        should_apply = tf.TensorArray(tf.bool, num_steps)
        for step in tf.range(num_steps):
            _, ok = reference.update(
                [worker_program.gradients_for(poison, step, replica)
                 for replica in range(num_replicas)])
            with tf.control_dependencies([ok]):
                scales = scales.write(step, reference())
            should_apply = should_apply.write(step, ok)
        return scales.stack(), should_apply.stack()

    scales, should_apply = run_all()
    return scales.numpy().tolist(), should_apply.numpy().tolist()


@pytest.mark.parametrize("context", CONTEXTS)
def test_workers_agree_on_every_step_when_only_worker_1_overflows(
        worker_traces, context):
    job, traces = worker_traces
    worker_0, worker_1 = traces[context]
    assert worker_0["num_replicas"] == worker_1["num_replicas"] == NUM_WORKERS
    assert worker_0["should_apply"] == worker_1["should_apply"]
    assert worker_0["scale"] == worker_1["scale"]
    # Worker 0's own gradients are always finite: it skips only because it
    # learned of worker 1's overflow.
    poisoned_steps = [step for step, row in enumerate(job["poison"])
                      if not np.isfinite(row[POISONED_WORKER])]
    assert poisoned_steps
    assert all(not worker_0["should_apply"][step] for step in poisoned_steps)


@pytest.mark.parametrize("context", CONTEXTS)
def test_workers_follow_single_device_algorithm(
        worker_traces, single_device_trace, context):
    _, traces = worker_traces
    expected_scale, expected_should_apply = single_device_trace
    for observed in traces[context]:
        assert observed["scale"] == expected_scale
        assert observed["should_apply"] == expected_should_apply


@pytest.mark.parametrize("context", CONTEXTS)
def test_every_local_replica_and_copy_sees_the_shared_scale(
        worker_traces, context):
    _, traces = worker_traces
    for observed in traces[context]:
        for step, scale in enumerate(observed["scale"]):
            assert set(observed["replica_scale_reads"][step]) == {scale}
            assert set(observed["variable_values"][step]) == {scale}
            assert set(observed["replica_should_apply"][step]) == {
                observed["should_apply"][step]}


@pytest.mark.parametrize("context", CONTEXTS)
def test_update_all_reduces_one_value_across_workers_per_step(
        worker_traces, context):
    # A collective per gradient (or none, deciding locally) would show here.
    _, traces = worker_traces
    for observed in traces[context]:
        assert observed["collective_reductions_per_step"] == 1


def test_both_workers_fail_on_the_same_step_with_the_same_state(
        worker_traces):
    _, traces = worker_traces
    worker_0, worker_1 = traces["failure"]
    model = dynamic_rule_model.RuleModel(**FAILURE["loss_scale"])
    expected_scales = []
    for row in FAILURE["poison"]:
        failure = model.step(all(np.isfinite(row)))
        if failure:
            break
        expected_scales.append(float(model.scale))
    assert failure == "raise"
    expected_state = {"current_loss_scale": float(model.scale),
                      "good_steps": model.good_steps,
                      "hysteresis_remaining": model.hysteresis_left,
                      "consecutive_skips": model.skips_in_a_row}
    for observed in (worker_0, worker_1):
        assert observed["failed_at_step"] == len(expected_scales) == 4
        assert observed["error_type"] == "InvalidArgumentError"
        assert "min_loss_scale=1.0" in observed["error"]
        assert "non-finite gradients: 3" in observed["error"]
        assert observed["scale"] == expected_scales
        # Every local copy holds the state after the failing (skipped) step.
        assert observed["state"] == {
            name: [value] for name, value in expected_state.items()}


# Parameter-server training needs a cluster; connecting to one changes the
# process's devices for good, so it runs in a process of its own.
PARAMETER_SERVER_PROGRAM = r"""
import contextlib
import json
import socket

import tensorflow as tf
import tf_lossscale


def address():
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def value_error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


cluster = tf.train.ClusterSpec({"worker": [address()], "ps": [address()]})
servers = [tf.distribute.Server(cluster, job_name=job, task_index=0)
           for job in ("worker", "ps")]
strategy = tf.distribute.experimental.ParameterServerStrategy(
    tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, rpc_layer="grpc"))
errors = {}
with strategy.scope():
    errors["create"] = value_error(tf_lossscale.DynamicLossScale)
loss_scale = tf_lossscale.DynamicLossScale()
with strategy.scope():
    errors["update"] = value_error(
        lambda: loss_scale.update([tf.constant([1.0])]))
# Refused before touching the state.
errors["unchanged"] = float(loss_scale()) == loss_scale.initial_loss_scale
print(json.dumps(errors), flush=True)
"""


def test_parameter_server_strategy_is_refused_with_clear_error():
    with tempfile.TemporaryDirectory(prefix="tf_lossscale_ps_") as tmp:
        completed = subprocess.run(
            [sys.executable, "-c", PARAMETER_SERVER_PROGRAM],
            capture_output=True, text=True, cwd=tmp,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
            timeout=WORKER_TIMEOUT_SECONDS)
    assert completed.returncode == 0, completed.stderr[-STDERR_TAIL_CHARS:]
    errors = json.loads(completed.stdout.strip().splitlines()[-1])
    assert "ParameterServerStrategy" in (errors["create"] or "")
    assert "ParameterServerStrategy" in (errors["update"] or "")
    assert errors["unchanged"]

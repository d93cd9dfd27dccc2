"""DynamicLossScale across real worker processes.

The session's multi-worker job (`tests/scripts/multi_worker_job.py`: two
processes on 127.0.0.1 forming a `MultiWorkerMirroredStrategy` cluster) drives
a loss scale (`multi_worker_loss_scale_worker.py`); only worker 1 sees
non-finite gradients. If the workers decided separately, worker 0 would apply
a step that worker 1 skips and the next gradient all-reduce would wait for a
peer that never joins. The tests pin down that both workers report the same
trace, and that it is the trace of the single-device algorithm fed both
workers' gradients. The same job then runs a loss scale with
on_min_loss_scale="raise" into its floor: both workers must fail on the same
step with the same error (a worker that failed alone would leave its peer
hanging in the next all-reduce).

Parameter-server training cannot wait for such a shared verdict; a separate
process checks that it is refused with a clear error.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import dynamic_rule_model
from tests.scripts import multi_worker_job
from tests.scripts import multi_worker_loss_scale_worker as worker_program
from tests.helpers import subprocesses

NUM_WORKERS = worker_program.NUM_WORKERS
POISONED_WORKER = worker_program.POISONED_WORKER
CONTEXTS = worker_program.CONTEXTS
FAILURE = worker_program.FAILURE
# Bounds a hung process, not a speed requirement.
_TIMEOUT_SECONDS = 300

pytestmark = [pytest.mark.multi_worker("loss_scale"),
              pytest.mark.xdist_group("multi_worker")]


@pytest.fixture(scope="module")
def worker_traces(multi_worker_results):
    """{context: [worker 0's observations, worker 1's observations]}."""
    traces = {}
    for task_id, observations in enumerate(
            multi_worker_job.reports(multi_worker_results, "loss_scale")):
        assert len(observations) == len(CONTEXTS) + 1, observations
        for observed in observations:
            assert observed["task_id"] == task_id
            traces.setdefault(observed["context"], []).append(observed)
    return worker_program.make_job(), traces


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
    errors = subprocesses.run_json(["-c", PARAMETER_SERVER_PROGRAM],
                                   timeout=_TIMEOUT_SECONDS)
    assert "ParameterServerStrategy" in (errors["create"] or "")
    assert "ParameterServerStrategy" in (errors["update"] or "")
    assert errors["unchanged"]

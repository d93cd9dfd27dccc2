"""`LossScaleOptimizer` under MultiWorkerMirroredStrategy with two processes.

The session's multi-worker job (`tests/scripts/multi_worker_job.py`) trains
one model in a custom loop on two local workers; only worker 1 ever sees a
NaN. Every worker has to skip those steps: a worker that applied while the
other skipped would wait in the gradient all-reduce for a peer that never
comes (REFERENCE.md: Keras 3's own LossScaleOptimizer kills the job that way).

Keras 3.15's `model.fit` fails under this strategy even in float32 without
loss scaling, so only custom loops are tested here.
"""

import keras
import numpy as np
import pytest

from tests.scripts import multi_worker_job as job_lib

_JOB = job_lib.JOB
_NUM_WORKERS = job_lib.NUM_WORKERS

pytestmark = [pytest.mark.multi_worker("keras_3"),
              pytest.mark.xdist_group("multi_worker")]


def test_nan_on_one_worker_skips_the_step_on_every_worker(
        multi_worker_results):
    reports = job_lib.reports(multi_worker_results, "keras_3")

    assert sorted(r["task_id"] for r in reports) == [0, 1]
    assert all(r["num_replicas"] == _NUM_WORKERS for r in reports)
    first, second = reports
    np.testing.assert_array_equal(first["weights"], second["weights"])
    assert first["scale"] == second["scale"]
    assert first["iterations"] == second["iterations"]
    assert first["skipped_steps"] == second["skipped_steps"]
    # The overflow record names the same variables on every worker, also on
    # worker 0, whose own gradients were finite: none before the first NaN
    # step, then those of the last skipped step.
    assert first["last_nonfinite"] == second["last_nonfinite"]
    first_nan = min(_JOB["nan_steps"])
    assert first["last_nonfinite"][:first_nan] == [[]] * first_nan
    assert all(names for names in first["last_nonfinite"][first_nan:])

    weights = np.array(first["weights"])
    assert np.isfinite(weights).all()
    assert first["scale"] == job_lib.reference_scale_trace(_JOB)
    num_nan_steps = len(_JOB["nan_steps"])
    assert first["skipped_steps"][-1] == num_nan_steps
    assert first["iterations"][-1] == _JOB["steps"] - num_nan_steps
    # Comparing with one device also shows that the applied steps used the
    # gradients of both workers.
    np.testing.assert_allclose(
        weights, job_lib.single_process_weights(_JOB, keras),
        rtol=1e-5, atol=1e-6)


@pytest.mark.multi_worker("keras_3_group")
def test_a_group_block_on_two_workers_skips_one_optimizer_without_collectives_of_its_own(
        multi_worker_results):
    first, second = job_lib.reports(multi_worker_results, "keras_3_group")
    for key in ("weights", "scale", "skipped_steps"):
        assert first[key] == second[key], key
    # The NaN of worker 1 skips the second optimizer's step everywhere.
    nan_steps = _JOB["nan_steps"]
    assert first["skipped_steps"] == [
        [0, sum(nan <= step for nan in nan_steps)]
        for step in range(_JOB["steps"])]
    # One step of the scale per iteration.
    assert first["scale"] == job_lib.reference_scale_trace(_JOB)
    # No collective of the group's own: the step holds the gradients'
    # all-reduces, as many as the inner optimizers alone make.
    assert first["collectives"] == first["plain_collectives"] > 0
    np.testing.assert_allclose(
        np.array(first["weights"]),
        job_lib.single_process_group_weights(_JOB, keras),
        rtol=1e-5, atol=1e-6)

"""The tf-keras wrapper under MultiWorkerMirroredStrategy, two processes.

The job of `test_keras_multi_worker.py` (a NaN on worker 1 only, at two
steps) with tf-keras (`tf_keras` imported in the session's multi-worker
job): every worker must skip those steps, and the applied steps must be those
of one device training on both workers' batches (replayed here with
`tf_keras`).
"""

import numpy as np
import pytest
import tf_keras

from tests.scripts import multi_worker_job as job_lib

pytestmark = [pytest.mark.multi_worker("tf_keras"),
              pytest.mark.xdist_group("multi_worker")]


def test_nan_on_one_worker_skips_the_step_on_every_tf_keras_worker(
        multi_worker_results):
    job = job_lib.JOB
    first, second = job_lib.reports(multi_worker_results, "tf_keras")

    assert sorted(r["task_id"] for r in (first, second)) == [0, 1]
    assert first["num_replicas"] == second["num_replicas"] == 2
    for key in ("weights", "scale", "iterations", "skipped_steps"):
        assert first[key] == second[key], key
    assert first["scale"] == job_lib.reference_scale_trace(job)
    assert first["skipped_steps"][-1] == len(job["nan_steps"])
    assert first["iterations"][-1] == job["steps"] - len(job["nan_steps"])
    np.testing.assert_allclose(
        np.array(first["weights"]),
        job_lib.single_process_weights(job, tf_keras),
        rtol=1e-5, atol=1e-6)

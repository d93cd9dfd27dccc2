"""A model scaled per layer under MultiWorkerMirroredStrategy, two processes.

The session's multi-worker job (`tests/scripts/multi_worker_job.py`, scenario
"layerwise") trains it in a custom loop on two local workers; only worker 1
sees a NaN. Both must skip that step and agree, step by step, on the loss
scale, every factor and every weight (one that applied while the other
skipped would wait in the gradient all-reduce forever).
"""

import numpy as np
import pytest

from tests.scripts import multi_worker_job as job_lib
from tests.scripts import multi_worker_layerwise_worker as worker

pytestmark = [pytest.mark.multi_worker("layerwise"),
              pytest.mark.xdist_group("multi_worker")]


def test_workers_agree_on_every_factor_and_skip_a_nan_on_one(
        multi_worker_results):
    first, second = job_lib.reports(multi_worker_results, "layerwise")

    assert sorted([first["task_id"], second["task_id"]]) == [0, 1]
    for key in ("scale", "factors", "skipped_steps"):
        assert first[key] == second[key], key
    np.testing.assert_array_equal(first["weights"], second["weights"])
    nan_step = worker.JOB["nan_steps"][0]
    assert first["skipped_steps"][nan_step] == 1
    assert first["skipped_steps"][-1] == 1
    np.testing.assert_array_equal(first["weights"][nan_step],
                                  first["weights"][nan_step - 1])
    assert np.isfinite(first["weights"]).all()
    low_1, low_2 = first["factors"][-1][:2]
    assert min(low_1, low_2) >= 2.0**30, first["factors"]

"""`FailureWatch.after_step` under MultiWorkerMirroredStrategy, two local
workers (`tests/scripts/multi_worker_watch_worker.py`): both decide from the
agreed loss-scale state, so they fail at the same step for the same reason
and run the diagnosis' collectives together; only the chief writes the
report; the run carried on applies its steps on both alike."""

import numpy as np
import pytest

from tests.scripts import multi_worker_job as job_lib
from tests.scripts import multi_worker_watch_worker as watch_worker

pytestmark = [pytest.mark.multi_worker("watch"),
              pytest.mark.xdist_group("multi_worker")]


@pytest.fixture
def workers(multi_worker_results):
    chief, other = job_lib.reports(multi_worker_results, "watch")
    assert (chief["task_id"], other["task_id"]) == (0, 1)
    return chief, other


def test_every_worker_fails_at_the_same_step_for_the_same_cause(workers):
    chief, other = workers
    for key in ("step", "reason", "cause", "scale", "skipped_steps",
                "first_nonfinite_layer"):
        assert chief[key] == other[key], key
    # The planted growth overflows the float16 logits, and the diagnosis
    # names them (not the loss, which the watch cannot agree on here).
    assert chief["first_nonfinite_layer"] == "logits"
    assert "3 steps in a row were skipped" in chief["reason"]
    # Noticed at the third skip in a row, in the loop's last step.
    assert chief["skipped_steps"][-3:] == [1, 2, 3]
    assert chief["step"] == len(chief["scale"])
    assert chief["step"] < watch_worker.JOB["max_steps"]


def test_only_the_chief_writes_the_report(workers):
    chief, other = workers
    assert {"report.txt", "report.json", "bundle", "logs"} <= set(
        chief["wrote"])
    assert other["wrote"] == []


def test_the_run_carried_on_applies_its_steps_on_every_worker(workers):
    chief, other = workers
    for report in workers:
        assert report["fixed_dtype"] == "float32"
        assert np.all(np.isfinite(report["losses_after"]))
        # No step skipped since the failure's, every one applied.
        assert report["skipped_after"] == [report["skipped_steps"][-1]] * (
            watch_worker.JOB["steps_after"])
        at_failure, at_end = report["iterations"]
        assert at_end == at_failure + watch_worker.JOB["steps_after"]
    assert chief["losses_after"] == other["losses_after"]
    np.testing.assert_array_equal(chief["weights_after"],
                                  other["weights_after"])

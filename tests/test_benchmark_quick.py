"""The benchmark runs end to end (its quick mode; no timing is asserted)."""

import io
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]
                       / "benchmarks"))

import loss_scale_benchmark  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.usefixtures("keras_isolation")


def test_quick_benchmark_reports_every_section_and_a_verdict_per_target():
    out = io.StringIO()
    verdicts = loss_scale_benchmark.run(quick=True, out=out)
    text = out.getvalue()
    for heading in ("1. Check + unscale + update", "2. Keras-protocol apply",
                    "3. model.fit", "4. The barrier"):
        assert heading in text
    # Two targets per gradient set in (1), one per set in (2), two in (3):
    # the wrapper's fit overhead and the monitor's.
    assert len(verdicts) == 3 * 2 + 3 + 2
    for description, _ in verdicts:
        assert f"target {description}:" in text
    assert f"Targets holding: {sum(h for _, h in verdicts)} of 11" in text
    assert "LossScaleMonitor adds" in text
    assert "tf_lossscale by parts: the unscale" in text

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
                    "3. model.fit", "4. The barrier", "5. model.fit of the "
                    "same 6x16 MLP under XLA"):
        assert heading in text
    # In (1) one target per gradient set and one more per large set, one
    # per set in (2), two in (3) (the wrapper's fit overhead and the
    # monitor's), one in (5) (the XLA fit overhead).
    sets = loss_scale_benchmark.gradient_sets(quick=True)
    large = sum(loss_scale_benchmark.is_large(s) for s in sets.values())
    assert large >= 1
    expected = len(sets) + large + len(sets) + 2 + 1
    assert len(verdicts) == expected
    for description, _ in verdicts:
        assert f"target {description}:" in text
    assert (f"Targets holding: {sum(h for _, h in verdicts)} of {expected}"
            in text)
    assert "CPU overhead over no loss scaling under XLA" in text
    assert "LossScaleMonitor adds" in text
    assert "tf_lossscale by parts: the unscale" in text

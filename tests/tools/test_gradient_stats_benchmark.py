"""The gradient statistics benchmark runs end to end (its quick mode; no
timing is asserted: speed claims live in the benchmark's output)."""

import io
import sys

import pytest

from tests.support import paths

sys.path.insert(0, str(paths.ROOT / "benchmarks"))

import gradient_stats_cost  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.usefixtures("keras_isolation")


def test_quick_benchmark_prints_both_sections_with_a_ratio_each():
    out = io.StringIO()

    results = gradient_stats_cost.run(quick=True, out=out)

    text = out.getvalue()
    assert "1. Per-step statistics against the finiteness check" in text
    assert "2. model.fit with LossScaleMonitor" in text
    sets = gradient_stats_cost.gradient_sets(quick=True)
    assert sorted(results["statistics_vs_check"]) == sorted(sets)
    for name in sets:
        assert f"  {name}" in text
    ratios = list(results["statistics_vs_check"].values()) + list(
        results["fit"]) + list(results["fit_xla"])
    assert all(0 < ratio < float("inf") for ratio in ratios)
    assert "no XLA: CPU time x" in text
    assert "XLA (jit_compile=True): CPU time x" in text


def test_main_refuses_unknown_arguments():
    with pytest.raises(SystemExit, match="unknown arguments: --slow"):
        gradient_stats_cost.main(["--slow"])

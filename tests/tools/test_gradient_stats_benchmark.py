"""The gradient statistics section of the benchmark runs end to end (quick
mode, conftest's `quick_benchmark`; no timing is asserted: speed claims live
in the benchmark's output)."""

import sys

import pytest

from tests import helpers

sys.path.insert(0, str(helpers.ROOT / "benchmarks"))

from lsbench import gradient_sets  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import fit_step  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import gradient_stats  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.usefixtures("keras_isolation")


@pytest.mark.xdist_group("quick_benchmark")
def test_quick_section_prints_both_parts_and_a_cost_row_per_compile_mode(
        quick_benchmark):
    results = quick_benchmark.report.results[gradient_stats.NAME]
    text = quick_benchmark.section_text(gradient_stats)
    assert text.startswith(f"\n{gradient_stats.NAME}: {gradient_stats.TITLE}")
    sets = gradient_sets.gradient_sets(quick=True)
    assert sorted(results["statistics_vs_check"]) == sorted(sets)
    for name in sets:
        assert f"  {name}" in text
    assert all(0 < ratio < float("inf")
               for ratio in results["statistics_vs_check"].values())
    assert "no XLA: CPU time x" in text
    assert "XLA (jit_compile=True): CPU time x" in text
    # The statistics' cost is a finite share of an unscaled step, per mode.
    for key in ("fit", "fit_xla"):
        assert -1.0 < results[key] < float("inf"), key
    features = next(t for t in quick_benchmark.report.tables
                    if t.title == fit_step.FEATURES_TITLE)
    assert [row[1] for row in features.rows
            if row[0] == gradient_stats.FEATURE] == ["no XLA", "XLA"]


def test_the_runner_runs_it_by_name():
    import loss_scale_benchmark  # pylint: disable=g-import-not-at-top
    assert gradient_stats in loss_scale_benchmark.SECTIONS
    assert gradient_stats.NAME == "stats"

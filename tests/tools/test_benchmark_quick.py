"""The benchmark runs end to end (its quick mode; no timing is asserted).

What the Performance guide is regenerated from must be in one run's output:
the machine and its load before and after, every section, a verdict per
target, a cost for every feature the ablations take away, and every table
again in Markdown. The run is conftest's `quick_benchmark`, shared with the
tests of the hot path and the gradient statistics sections.
"""

import io
import sys

import pytest

from tests import helpers

sys.path.insert(0, str(helpers.ROOT / "benchmarks"))

import loss_scale_benchmark  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench import ablations  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench import gradient_sets  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import collectives  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import fit_step  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import step_ops  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import two_workers  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.usefixtures("keras_isolation")


@pytest.mark.xdist_group("quick_benchmark")
def test_quick_benchmark_reports_every_section_and_a_verdict_per_target(
        quick_benchmark):
    verdicts, text = quick_benchmark.report.verdicts, quick_benchmark.text
    assert text.startswith("Machine: ")
    assert "Load average (1, 5, 15 min) at the start" in text
    assert "Load average (1, 5, 15 min) at the end" in text
    for section in loss_scale_benchmark.SECTIONS:
        assert f"\n{section.NAME}: {section.TITLE}" in text
    # What each section's run returned, kept by name.
    assert list(quick_benchmark.report.results) == [
        section.NAME for section in loss_scale_benchmark.SECTIONS]
    # One target per gradient set in `check` and one more per large set,
    # one per set in `apply`, one in `ops` (quick runs compile one set), one
    # per strategy and row in `collectives`, two in `fit` (the wrapper's
    # overhead and the monitor's), one in `xla`, one in `replicas`, one in
    # `workers`, one per set and one per compile mode in `stats`, three in
    # `layerwise` (its demonstration, its ops and its fit overhead; quick
    # runs compile no XLA), one in `watch`.
    sets = gradient_sets.gradient_sets(quick=True)
    large = sum(gradient_sets.is_large(s) for s in sets.values())
    assert 1 <= large < len(sets)  # Both of `check`'s kinds of set.
    expected = (len(sets) + large + len(sets) + 1
                + len(collectives.STRATEGIES) * len(collectives.ROWS)
                + 2 + 1 + 1 + 1 + len(sets) + 2 + 3 + 1)
    assert len(verdicts) == expected
    for description, _ in verdicts:
        assert f"target {description}:" in text
    assert (f"Targets holding: {sum(h for _, h in verdicts)} of {expected}"
            in text)
    markdown = text[text.index("The tables in Markdown"):]
    features = markdown[markdown.index(f"**{fit_step.FEATURES_TITLE}**"):]
    for ablation in ablations.ABLATIONS:
        assert f"\n| {ablation.feature}" in features, ablation.feature
    for section in loss_scale_benchmark.SECTIONS:
        assert f"**{section.TITLE}" in markdown, section.NAME


@pytest.mark.xdist_group("quick_benchmark")
def test_ops_section_counts_ops_and_kernels_of_every_form_on_every_set(
        quick_benchmark):
    counts = quick_benchmark.report.results[step_ops.NAME]
    assert list(counts) == [*gradient_sets.gradient_sets(quick=True),
                            "fit MLP"]
    for index, (set_name, forms) in enumerate(counts.items()):
        assert list(forms) == list(step_ops.FORMS), set_name
        for form, (ops, launches) in forms.items():
            case = f"{set_name}: {form}"
            assert isinstance(ops, int) and ops > 0, case
            if index > 0:  # Quick runs compile the first set alone.
                assert launches is None, case
                continue
            assert isinstance(launches.kernels, int), case
            assert launches.kernels > launches.conditionals >= 0, case
            assert launches.kernels == sum(launches.by_opcode.values()), case
    table = next(t for t in quick_benchmark.report.tables
                 if t.title == step_ops.TITLE)
    assert [row[0] for row in table.rows] == list(counts)


@pytest.mark.xdist_group("quick_benchmark")
def test_collectives_section_counts_every_form_on_every_row_and_strategy(
        quick_benchmark):
    counts = quick_benchmark.report.results[collectives.NAME]
    assert list(counts) == list(collectives.STRATEGIES)
    for strategy, rows in counts.items():
        assert list(rows) == list(collectives.ROWS), strategy
        for row, forms in rows.items():
            assert list(forms) == list(collectives.FORMS), (strategy, row)
            # Exact counts: the gradients' own all-reduce is always there,
            # and this package adds none (tests/step pins it too).
            assert forms[collectives.PLAIN] > 0, (strategy, row)
            assert forms[collectives.OURS] == forms[collectives.PLAIN], (
                strategy, row)
    # Beside the XLA kernel counts in the Markdown summary.
    titles = [table.title for table in quick_benchmark.report.tables]
    assert titles.index(collectives.TITLE) == titles.index(step_ops.TITLE) + 1


@pytest.mark.xdist_group("quick_benchmark")
def test_workers_section_reports_each_worker_on_every_candidate(
        quick_benchmark):
    workers = quick_benchmark.report.results[two_workers.NAME]
    assert [w["task"] for w in workers] == list(range(two_workers.NUM_WORKERS))
    for worker in workers:
        for measure in ("cpu", "wall"):
            assert list(worker[measure]) == list(two_workers.CANDIDATES)
            assert worker[measure][two_workers.BASELINE] == 1.0


def test_only_runs_the_sections_named_and_refuses_unknown_ones():
    out = io.StringIO()
    # The cheapest section: eager work, no trace.
    report = loss_scale_benchmark.run(quick=True, only=["checks"], out=out)
    assert report.verdicts == []
    assert list(report.results) == ["checks"]
    assert "\nchecks: " in out.getvalue()
    assert "\napply: " not in out.getvalue()
    with pytest.raises(ValueError, match="unknown sections.*'nope'"):
        loss_scale_benchmark.run(quick=True, only=["nope"], out=io.StringIO())

"""The benchmark's hot-path comparison runs, and its forms give the plain
form's results bit for bit (quick mode, conftest's `quick_benchmark`; no
timing is asserted: speed claims live in the benchmark's output and
docs/guides/performance.md)."""

import sys

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers

sys.path.insert(0, str(helpers.ROOT / "benchmarks"))

from lsbench import gradient_sets  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench import hot_path_forms as forms  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import hot_path  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_lossscale.ops import finiteness  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_lossscale.ops import unscaling  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.usefixtures("keras_isolation")

# Tiny (packed), small (stacked) of two shapes, large (summed), unknown to
# no form: every path of every form.
_SHAPES = [(3,), (3,), (2, 2), (5,), (300, 300), (300, 300), (70000,)]


def _grads(dtype=tf.float32):
    rng = np.random.default_rng(0)
    return [tf.cast(tf.constant(rng.standard_normal(s) * 3e3), dtype)
            for s in _SHAPES]


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32,
                                   tf.float64], ids=lambda d: d.name)
def test_every_form_gives_the_plain_forms_results(dtype):
    hot_path.check_same_results(hot_path._groups(), _grads(dtype))  # pylint: disable=protected-access


def test_a_form_that_differs_is_refused():
    groups = hot_path._groups()  # pylint: disable=protected-access
    groups["unscale"]["off by 0.1%"] = lambda g, s: [
        q * tf.constant(1.001, q.dtype) for q in forms.plain_unscale(g, s)]
    with pytest.raises(AssertionError, match="'off by 0.1%' differs"):
        hot_path.check_same_results(groups, _grads())


def test_the_plain_step_runs_the_plain_parts():
    counts = {}
    for name, step in hot_path._apply_steps(  # pylint: disable=protected-access
            [(5,), (5,), (300, 300)], jit_compile=False).items():
        step()
        counts[name] = hot_path.op_counts.op_types(step)
    plain, package = counts[hot_path.PLAIN], counts[hot_path.PACKAGE]
    # Plain: a divide per gradient, where the package packs the two tiny
    # ones; and no sum, where the package sums the large one.
    assert plain["RealDiv"] - package["RealDiv"] == 1
    assert package["Sum"] - plain["Sum"] == 1
    assert counts[hot_path.PLAIN] == counts[hot_path.AGAIN]


@pytest.mark.xdist_group("quick_benchmark")
def test_quick_section_reports_every_form_in_both_modes(quick_benchmark):
    text = quick_benchmark.section_text(hot_path)
    assert text.startswith(f"\n{hot_path.NAME}: {hot_path.TITLE}")
    forms_per_set = sum(len(c) for c in hot_path._groups().values()) + 3  # pylint: disable=protected-access
    for index, set_name in enumerate(gradient_sets.gradient_sets(quick=True)):
        table = next(t for t in quick_benchmark.report.tables
                     if t.title == f"{hot_path.TITLE}: {set_name}")
        assert len(table.rows) == forms_per_set, set_name
        assert table.rows[1][-1] == "(the noise)", set_name
        for row in table.rows:
            ops, graph, xla = row[2], row[3], row[4]
            case = f"{set_name}: {row[0]}: {row[1]}"
            assert int(ops.split()[0]) > 0, case
            assert float(graph) > 0, case
            if index == 0:  # Quick runs compile this set alone under XLA.
                assert float(xla) > 0, case
            else:
                assert xla == "-", case
    assert "target " not in text  # It decides nothing: no target.


def test_the_quick_set_compiled_under_xla_takes_every_path():
    shapes = next(iter(gradient_sets.gradient_sets(quick=True).values()))
    sizes = [int(np.prod(shape)) for shape in shapes]
    # The forms' thresholds are the package's.
    assert (forms.TINY, forms.SMALL) == (
        unscaling._PACKED_ELEMENTS, finiteness._STACKED_ELEMENTS)  # pylint: disable=protected-access
    assert [n for n in sizes if n <= forms.TINY], "tiny (packed)"
    assert [n for n in sizes if forms.TINY < n <= forms.SMALL], "small"
    assert [n for n in sizes if n > forms.SMALL], "large (summed)"

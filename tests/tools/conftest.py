"""One quick run of the benchmark (benchmarks/loss_scale_benchmark.py) per
session, for the tests of what it reports: test_benchmark_quick.py,
test_hot_path_benchmark.py and test_gradient_stats_benchmark.py. Those tests
are in the xdist group "quick_benchmark", so that one worker runs it."""

import io
import sys
from typing import NamedTuple

import keras
import pytest

from tests import helpers


class QuickRun(NamedTuple):
    """The `Report` that `run(quick=True)` returned, and what it printed."""
    report: object
    text: str

    def section_text(self, section):
        """What `section` printed: from its heading to the next one."""
        import loss_scale_benchmark  # pylint: disable=g-import-not-at-top
        start = self.text.index(f"\n{section.NAME}: ")
        ends = [self.text.index("\nLoad average (1, 5, 15 min) at the end")]
        for other in loss_scale_benchmark.SECTIONS:
            end = self.text.find(f"\n{other.NAME}: ", start + 1)
            if end != -1:
                ends.append(end)
        return self.text[start:min(ends)]


@pytest.fixture(scope="session")
def quick_benchmark():
    """The benchmark's quick run: a `QuickRun`."""
    sys.path.insert(0, str(helpers.ROOT / "benchmarks"))
    import loss_scale_benchmark  # pylint: disable=g-import-not-at-top
    # The run sets the global policy; a session fixture is set up before the
    # test's keras_isolation saves it, so it gives it back here.
    policy = keras.mixed_precision.global_policy()
    out = io.StringIO()
    try:
        report = loss_scale_benchmark.run(quick=True, out=out)
    finally:
        keras.mixed_precision.set_global_policy(policy)
    return QuickRun(report, out.getvalue())

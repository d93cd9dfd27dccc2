"""What `diagnose` shows while it runs, as Keras' `fit` does: `verbose=0`
nothing, 1 Keras' progress bar over its passes, 2 a line per phase (the
copies rebuilt, then each batch with the scale its backward pass overflows
from), and "auto" the bar in a terminal or notebook, else the lines. `fix`
shows the same for each diagnosis it runs."""

import io
import re
import sys

import keras
import pytest

import tf_lossscale
from tf_lossscale.diagnosis import progress

from tests.helpers import float16_models  # pylint: disable=g-bad-import-order

pytestmark = [pytest.mark.usefixtures("keras_isolation"),
              pytest.mark.xdist_group("diagnosis_progress")]

_SCALES = [1.0, 2.0**12, 2.0**24, 2.0**30]


@pytest.fixture(scope="module")
def model():
    return float16_models.underflowing_model(keras)


def _shown(model, capsys, **kwargs):
    tf_lossscale.diagnose(model, float16_models.underflowing_data()[:2],
                          scales=_SCALES, **kwargs)
    return capsys.readouterr().out


def test_verbose_0_shows_nothing(model, capsys):
    assert _shown(model, capsys, verbose=0) == ""


def test_verbose_2_shows_a_line_per_phase(model, capsys):
    lines = _shown(model, capsys, verbose=2).splitlines()

    assert len(lines) == 3
    assert lines[0].startswith("diagnose 'underflowing': rebuilt a float32 "
                               "twin and a float16 copy (")
    # The first probed scale from which the batch's backward pass overflows.
    assert re.match(r"diagnose 'underflowing': batch 1/2: float32 twin, "
                    r"float16 backward pass overflows from 2\^(24|30) ",
                    lines[1]), lines[1]
    assert lines[2].startswith("diagnose 'underflowing': batch 2/2: ")
    assert all(line.endswith(" s)") for line in lines)


def test_verbose_1_shows_keras_progress_bar_over_the_passes(model, capsys):
    out = _shown(model, capsys, verbose=1)

    # Keras' bar, at its end: every pass of 2 batches (a float32 one and 4
    # scales each), run or skipped past an overflow.
    assert "10/10" in out
    assert "diagnose" not in out


@pytest.mark.parametrize("interactive, expected", [(True, 1), (False, 2)])
def test_auto_is_the_bar_in_a_terminal_else_the_lines(monkeypatch,
                                                      interactive, expected):
    terminal = io.StringIO()
    terminal.isatty = lambda: interactive
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)

    assert progress.check_verbose("auto") == expected


@pytest.mark.parametrize("verbose", [3, "yes", True, None, -1])
def test_bad_verbose_is_refused_naming_it(model, verbose):
    with pytest.raises(ValueError, match="verbose must be one of"):
        tf_lossscale.diagnose(model, float16_models.underflowing_data()[:1],
                              verbose=verbose)

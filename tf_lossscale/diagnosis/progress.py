"""What a float16 diagnosis shows while it runs, as Keras' `fit` does:
nothing (`verbose=0`), Keras' progress bar over its passes (1), or a line
per phase (2); `"auto"`: the bar in an interactive run, else the lines."""

import sys
import time

from tf_lossscale._internal import checks

VERBOSE = ("auto", 0, 1, 2)


def check_verbose(verbose):
    """`verbose` as 0, 1 or 2; ValueError naming it otherwise."""
    if isinstance(verbose, bool) or verbose not in VERBOSE:
        raise ValueError(
            f"verbose must be one of {VERBOSE}, got {checks.summary(verbose)}")
    if verbose == "auto":
        return 1 if _interactive() else 2
    return verbose


def _interactive():
    """A terminal or a notebook: where a progress bar redraws in place."""
    return sys.stdout.isatty() or "ipykernel" in sys.modules


class Progress:
    """The progress of `target` passes named `label`, shown per `verbose`
    (0, 1 or 2) with `keras` (the Keras module that made the model)."""

    def __init__(self, verbose, keras, target, label):
        self._verbose = verbose
        self._label = label
        self._start = time.perf_counter()
        self._bar = (keras.utils.Progbar(target, unit_name="pass")
                     if verbose == 1 else None)

    def advance(self, passes=1):
        """`passes` more passes done (or skipped)."""
        if self._bar is not None:
            self._bar.add(passes)

    def line(self, text):
        """One line, with the time since the start, at `verbose=2`."""
        if self._verbose == 2:
            print(f"{self._label}: {text} "
                  f"({time.perf_counter() - self._start:.1f} s)", flush=True)

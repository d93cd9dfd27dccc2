"""What every section gets: the report to print to and the run's settings."""

from typing import NamedTuple, Optional

from lsbench import report as report_module


class Settings(NamedTuple):
    """A run's settings; None means the default for `quick`.

    `quick` uses small gradient sets, a 1x16 MLP and one round: it checks
    that the benchmark runs; its figures mean nothing.
    """
    quick: bool = False
    rounds: Optional[int] = None  # Step-level sections' rounds.
    fit_steps: Optional[int] = None
    fit_rounds: Optional[int] = None

    @property
    def step_rounds(self):
        return self.rounds or (1 if self.quick else 15)

    @property
    def calls(self):
        """Calls per candidate per round in step-level sections."""
        return 1 if self.quick else 5


class Context(NamedTuple):
    report: report_module.Report
    settings: Settings

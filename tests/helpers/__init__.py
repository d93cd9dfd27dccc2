"""What the tests share and is no test: data, models and strategies they
train with, the two oracles of the dynamic rule (`reference_oracle`:
TensorFlow's own loss scales; `dynamic_rule_model`: an independent numpy
model of the extended rule), the hostile values, and `subprocesses`, which
runs the programs of `tests/scripts/`. Also where the tests find the
repository's files, whatever folder they are in.
"""

import pathlib

TESTS = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = TESTS / "scripts"
"""tests/scripts/: the programs tests run in processes of their own."""

FIXTURES = TESTS / "fixtures"
"""tests/fixtures/: files written by earlier releases, which must load."""

ROOT = TESTS.parent
"""The repository's root: README.md, setup.py, configs/, docs/, benchmarks/."""

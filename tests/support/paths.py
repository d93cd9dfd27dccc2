"""Where the tests find the repository's files, whatever folder they are in."""

import pathlib

SUPPORT = pathlib.Path(__file__).resolve().parent
"""tests/support/: the helper modules and the scripts tests run."""

TESTS = SUPPORT.parent
FIXTURES = TESTS / "fixtures"
"""tests/fixtures/: files written by earlier releases, which must load."""

ROOT = TESTS.parent
"""The repository's root: README.md, setup.py, configs/, docs/, benchmarks/."""


def script(name):
    """The path, as a string, of the script `tests/support/<name>`."""
    return str(SUPPORT / name)

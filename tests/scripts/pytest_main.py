"""Bazel's `main` for the py_test targets: runs pytest on one test file.

The BUILD file makes one py_test per `tests/<area>/test_*.py`, each with this
file as its main and the test file's path as its argument:

        python tests/scripts/pytest_main.py tests/keras/test_keras_fit.py [...]

It exits with pytest's status, so a failing test fails the Bazel target.
pytest is run from the runfiles tree, where `pytest.ini` and
`tests/conftest.py` sit above the test file, so both are picked up exactly as
in a plain `python -m pytest tests` run.

The Bazel test environment is honoured where pytest has an equivalent:
`XML_OUTPUT_FILE` (JUnit XML for Bazel's test.xml), `TEST_TMPDIR` (pytest's
temporary directories) and `TESTBRIDGE_TEST_ONLY` (`bazel test
--test_filter=EXPR` becomes `pytest -k EXPR`). Outside Bazel none of these is
set and the runner is a thin wrapper around `pytest.main`.
"""

import importlib.util
import os
import sys


def _keep_script_dir_in_runfiles():
    """Makes `sys.path[0]` this script's runfiles directory, not its target.

    Python puts the directory of the script it runs first on `sys.path`, with
    symlinks resolved. Runfiles are symlinks into the source tree, so under
    Bazel that entry would be the source tree's tests/scripts/ instead of the
    runfiles' copy, and modules could be imported from outside the runfiles.
    """
    linked = os.path.dirname(os.path.abspath(__file__))
    resolved = os.path.dirname(os.path.realpath(__file__))
    if linked != resolved and sys.path and sys.path[0] == resolved:
        sys.path[0] = linked


def _check_import_source():
    """Fails early if `tf_lossscale` would be imported from outside runfiles.

    Under Bazel the package must come from the runfiles (the source tree the
    target was built from), not from a copy installed in the environment, or
    the test would silently exercise other code. `find_spec` locates the
    package without importing it (and so without importing TensorFlow).
    """
    runfiles = os.environ.get("RUNFILES_DIR") or os.environ.get("TEST_SRCDIR")
    if not runfiles:
        return  # Not under Bazel: whatever the environment provides is right.
    spec = importlib.util.find_spec("tf_lossscale")
    origin = os.path.abspath(spec.origin) if spec and spec.origin else None
    root = os.path.abspath(runfiles) + os.sep
    if origin is None or not origin.startswith(root):
        sys.stderr.write(
            "pytest_main: tf_lossscale resolves to %r, not to the runfiles "
            "under %r; check the py_test's deps.\n" % (origin, root))
        sys.exit(4)


def pytest_args(argv, environ):
    """Returns the pytest arguments for `argv[1:]` under `environ`."""
    if len(argv) < 2:
        raise SystemExit("usage: %s TEST_FILE [PYTEST_OPTION...]" % argv[0])
    args = list(argv[1:])
    # The runfiles tree is not the place for pytest's cache. Bazel runs the
    # targets side by side already: one process each, not pytest.ini's xdist.
    args += ["-p", "no:cacheprovider", "-n", "0"]
    xml_output = environ.get("XML_OUTPUT_FILE")
    if xml_output:
        args.append("--junitxml=" + xml_output)
    test_tmpdir = environ.get("TEST_TMPDIR")
    if test_tmpdir:
        args.append("--basetemp=" + os.path.join(test_tmpdir, "pytest"))
    test_filter = environ.get("TESTBRIDGE_TEST_ONLY")
    if test_filter:
        args += ["-k", test_filter]
    return args


def main(argv):
    # Imported here so that `pytest_args` is usable without pytest installed.
    import pytest  # pylint: disable=g-import-not-at-top

    if os.environ.get("TEST_SRCDIR"):
        _keep_script_dir_in_runfiles()
    _check_import_source()
    return pytest.main(pytest_args(argv, os.environ))


if __name__ == "__main__":
    sys.exit(main(sys.argv))

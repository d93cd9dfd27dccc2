"""pytest.ini's guards for CI: a worker that crashes or hangs ends the run
as a failure naming the test, instead of a wait for CI's time limit.

pytest-xdist 3.8 under `--dist loadgroup` replaces a crashed worker and then
waits forever (pytest-xdist#1323, #1327): a segmentation fault in one test
once held CI until its 90-minute limit. These runs use pytest.ini as it
is, on test files without TensorFlow, so they take seconds.
"""

import subprocess
import sys

import pytest

from tests import helpers

_GROUPED_AND_PLAIN = """
import os
import time

import pytest


@pytest.mark.xdist_group("together_{n}")
def test_grouped_first():
    pass


@pytest.mark.xdist_group("together_{n}")
def test_grouped_second():
    pass


def test_plain_{n}():
    {body}
"""


def _run(tmp_path, failing_body, *options):
    for n in range(4):
        body = failing_body if n == 1 else "time.sleep(0.2)"
        (tmp_path / f"test_case_{n}.py").write_text(
            _GROUPED_AND_PLAIN.format(n=n, body=body))
    try:
        # Bounds the hang this guards against, not a speed requirement.
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-c",
             str(helpers.ROOT / "pytest.ini"), "--rootdir", str(tmp_path),
             "-n", "2", "-p", "no:cacheprovider", *options, str(tmp_path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the run did not end within 120 s: is a crashed worker "
                    "replaced (pytest.ini's --max-worker-restart)? "
                    "pytest-xdist then waits forever (pytest-xdist#1323)")


def test_a_crashed_worker_fails_the_run_naming_the_test(tmp_path):
    done = _run(tmp_path, "os.abort()")
    assert done.returncode == 1, done.stdout[-3000:]
    assert "crashed while running 'test_case_1.py::test_plain_1" in done.stdout


def test_a_hung_test_fails_the_run_with_every_threads_stack(tmp_path):
    done = _run(tmp_path, "time.sleep(600)", "-o", "faulthandler_timeout=2")
    assert done.returncode == 1, done.stdout[-3000:]
    output = done.stdout + done.stderr
    assert "Timeout (0:00:02)!" in output
    assert "crashed while running 'test_case_1.py::test_plain_1" in output

"""Under XLA nothing freezes in silence, however the step is run (Keras 3).

Each way of running an XLA-compiled step (`tests/support/xla_ways.py`, which
says what each asserts) is a test here with Keras 3; the same ways run with
tf-keras in one subprocess (`tests/support/tf_keras_xla_ways.py`), each
reported here as its own test.
"""

import json
import os
import subprocess
import sys

import keras
import pytest

import tf_lossscale
from tests.support import xla_ways
from tests.support import paths

pytestmark = pytest.mark.usefixtures("keras_isolation")

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(tf_lossscale.__file__))
# A bound for a hung process, not a speed requirement.
_TIMEOUT_SECONDS = 900


@pytest.mark.parametrize("way", xla_ways.WAYS)
def test_keras_3(way):
    xla_ways.WAYS[way](keras)


@pytest.fixture(scope="module")
def tf_keras_results():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, paths.script("tf_keras_xla_ways.py")],
        env=env, cwd=paths.SUPPORT, capture_output=True, text=True,
        timeout=_TIMEOUT_SECONDS, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("way", xla_ways.WAYS)
def test_tf_keras(tf_keras_results, way):
    assert tf_keras_results[way] == "ok", tf_keras_results[way]

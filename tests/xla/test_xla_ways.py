"""Under XLA nothing freezes in silence, however the step is run (Keras 3).

Each way of running an XLA-compiled step (`tests/support/xla_ways.py`, which
says what each asserts) is a test here with Keras 3; the same ways run with
tf-keras in one subprocess (`tests/support/tf_keras_xla_ways.py`), each
reported here as its own test.
"""

import keras
import pytest

from tests.support import subprocesses
from tests.support import xla_ways

pytestmark = pytest.mark.usefixtures("keras_isolation")

# A bound for a hung process, not a speed requirement.
_TIMEOUT_SECONDS = 900


@pytest.mark.parametrize("way", xla_ways.WAYS)
def test_keras_3(way):
    xla_ways.WAYS[way](keras)


@pytest.fixture(scope="module")
def tf_keras_results():
    return subprocesses.run_script("tf_keras_xla_ways.py",
                                   timeout=_TIMEOUT_SECONDS,
                                   TF_USE_LEGACY_KERAS="1")


@pytest.mark.parametrize("way", xla_ways.WAYS)
def test_tf_keras(tf_keras_results, way):
    assert tf_keras_results[way] == "ok", tf_keras_results[way]

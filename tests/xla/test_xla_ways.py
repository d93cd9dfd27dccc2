"""Under XLA nothing freezes in silence, however the step is run.

Each way of running an XLA-compiled step (`tests/scripts/xla_ways.py`, which
says what each asserts) is a test here with Keras 3, and one with tf-keras,
run in the session's tf-keras process.
"""

import keras
import pytest

from tests.scripts import xla_ways

pytestmark = pytest.mark.usefixtures("keras_isolation")


@pytest.mark.parametrize("way", xla_ways.WAYS)
def test_keras_3(way):
    xla_ways.WAYS[way](keras)


@pytest.mark.parametrize("way", xla_ways.WAYS)
def test_tf_keras(tf_keras_interpreter, way):
    tf_keras_interpreter.call("tests.scripts.xla_ways:run_with_tf_keras", way)

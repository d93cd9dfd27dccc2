"""Process-wide test setup: four logical CPU devices for multi-replica tests.

TensorFlow fixes its devices when it first initialises them, so the split has
to happen once, when pytest imports this file and before any test runs.
Single-device tests are unaffected: without a strategy everything runs on
CPU:0. Tests needing a fresh process (multi-worker) start their own.

Keras test files opt into `keras_isolation` with
`pytestmark = pytest.mark.usefixtures("keras_isolation")`; tests that need
`tf.keras` to be tf-keras ask for `tf_keras_interpreter` (one xdist worker
runs them all); multi-worker tests for `multi_worker_results`, marked with
the scenario they read and the xdist group "multi_worker".
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from tests.scripts import multi_worker_job  # pylint: disable=g-import-not-at-top
from tests.helpers import subprocesses  # pylint: disable=g-import-not-at-top

NUM_LOGICAL_CPUS = 4

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS)

# Not tf.data's debug mode (tf.data.experimental.enable_debug_mode), though
# it would spare the suite the waits of autotuned iterators destroyed under
# CPU load: under it, destroying a MirroredStrategy input iterator while its
# prefetch thread runs the pipeline's Python crashes the process (TF 2.21,
# MultiDeviceIterator: 5 of 6 runs of 40 `fit`s crashed under load, none of
# 240 `fit`s without debug mode).


@pytest.fixture(scope="module")
def _clear_keras_session_after_module():
    # Once per file: Keras' global state (layer names) starts afresh.
    yield
    # Without the full garbage collection clear_session would add (seconds
    # per file); Python's own collector still frees the models.
    keras.backend.clear_session(free_memory=False)


@pytest.fixture
def keras_isolation(_clear_keras_session_after_module):
    """Gives back the global dtype policy a test changed."""
    del _clear_keras_session_after_module
    policy = keras.mixed_precision.global_policy()
    yield
    keras.mixed_precision.set_global_policy(policy)


LONGEST_GROUPS = (
    "model_zoo_mobilenet_v2", "quick_benchmark", "watch_zoo_late_failure",
    "model_zoo_text", "tf_keras_interpreter", "multi_worker",
    "watch_late_failures", "model_zoo_mobilenet_v3_small", "watch_reach",
    "restore_across_wrapping", "diagnosis_reports_tf_keras_interpreter",
    "watch_per_layer", "fix_reports")
"""The xdist groups that take longest, longest first (`--durations=0` of
the whole suite, TF 2.21, idle 2 cores, 2026-11-29: from about 100 s of the
suite's 1,100 test-seconds for the first down to about 10 s). With `--dist
loadgroup` they are handed out first, so that no long group starts while the
other workers are running out of work; the tests outside any group fill in
at the end."""


def _group(item):
    """The xdist group of `item` as pytest-xdist names it (None: none)."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
             for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) or None


def _order(item):
    """The longest groups first, the other groups next, then the tests
    outside any group, which spread over the workers at the end."""
    group = _group(item)
    if group in LONGEST_GROUPS:
        return LONGEST_GROUPS.index(group)
    return len(LONGEST_GROUPS) + (group is None)


def pytest_configure(config):
    # xdist's default hands out the groups with most tests first; with
    # LONGEST_GROUPS' order the collection's is the better one.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # Before xdist reads the groups.
def pytest_collection_modifyitems(config, items):
    # With pytest.ini's xdist, one worker runs every test of the session's
    # tf-keras process (one more TensorFlow import saved).
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "tf_keras_interpreter" in fixtures:
            item.add_marker(pytest.mark.xdist_group("tf_keras_interpreter"))
        # The benchmark's whole run is a proof at scale (pytest.ini).
        if "quick_benchmark" in fixtures:
            item.add_marker(pytest.mark.at_scale)
    if getattr(config.option, "loadgroup", False):
        items.sort(key=_order)  # Stable: the collection's order otherwise.


@pytest.fixture(scope="session")
def tf_keras_interpreter():
    """One process for the session where `tf.keras` is tf-keras
    (`TF_USE_LEGACY_KERAS=1` before TensorFlow's import), which this
    process, having imported Keras 3, cannot give."""
    with subprocesses.Interpreter(TF_USE_LEGACY_KERAS="1") as interpreter:
        yield interpreter


@pytest.fixture(scope="session")
def multi_worker_results(request, tmp_path_factory):
    """{scenario: both workers' answers} of one MultiWorkerMirroredStrategy
    job on two local processes running the scenarios of every collected test
    marked `multi_worker(scenario)` (`tests/scripts/multi_worker_job.py`)."""
    scenarios = sorted({marker.args[0] for item in request.session.items
                        for marker in item.iter_markers("multi_worker")})
    return multi_worker_job.run(scenarios,
                                tmp_path_factory.mktemp("multi_worker"))

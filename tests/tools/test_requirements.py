"""The TensorFlow, Keras and tf-keras releases the package supports: what
setup.py declares, what `import tf_lossscale` checks, what README says.

setup.py names no TensorFlow in `install_requires` (installing the package
must never put a second TensorFlow distribution over the user's); extras
bring one. It requires Keras from the oldest supported release on.
`import tf_lossscale` refuses a missing TensorFlow, or a TensorFlow or Keras
older than supported, with an ImportError that says what to install, and
imports with one `UntestedReleaseWarning` when one is newer than tested;
tf-keras is checked the same way when the tf-keras wrapper is imported.

The checks run in this process on the installed modules given another
version string. What only an import shows runs in subprocesses: three
against a stand-in `tensorflow` package (or none), which never import the
real TensorFlow, and two that import it once each and run several steps.
"""

import functools
import importlib
from importlib import metadata
import json
import os
import pathlib
import re
import runpy
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import tensorflow as tf

from tests import helpers
import tf_lossscale
from tf_lossscale._internal import versions

_ROOT = helpers.ROOT
_README = (_ROOT / "README.md").read_text()
_PACKAGE_ROOT = str(pathlib.Path(tf_lossscale.__file__).parent.parent)

_RANGE = ">=2.16,<2.22"
_KERAS_FLOOR = ">=3.10"
_EXTRA_LINES = (
    'pip install "tf_lossscale[tensorflow]"',
    'pip install "tf_lossscale[tensorflow-cpu]"',
    'pip install "tf_lossscale[and-cuda]"',
)


def _setup_arguments():
    """The keyword arguments setup.py passes to `setuptools.setup`."""
    import setuptools  # pylint: disable=g-import-not-at-top
    captured = {}
    fake_setuptools = types.ModuleType("setuptools")
    fake_setuptools.setup = lambda **kwargs: captured.update(kwargs)
    fake_setuptools.find_packages = setuptools.find_packages
    saved = sys.modules.get("setuptools")
    sys.modules["setuptools"] = fake_setuptools
    try:
        runpy.run_path(str(_ROOT / "setup.py"), run_name="__main__")
    finally:
        if saved is None:
            del sys.modules["setuptools"]
        else:
            sys.modules["setuptools"] = saved
    return captured


def _requirement_name(requirement):
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()


def _assert_explains(message, version):
    assert version in message
    assert "2.16 to 2.21" in message
    assert _RANGE in message
    for line in _EXTRA_LINES:
        assert line in message


@functools.cache
def _tensorflow_distributions():
    """The pip distributions that install the `tensorflow` module here, from
    every distribution's metadata (the package looks up a few known names
    instead): e.g. {"tensorflow"}, or {"tensorflow", "tensorflow-cpu"} where
    tf-keras brought `tensorflow` beside a `tensorflow-cpu`."""
    return {re.sub(r"[-_.]+", "-", name).lower()
            for name in metadata.packages_distributions().get(
                "tensorflow", ())}


def _names_an_installed_tensorflow(message, specifier):
    """Whether `message` says to install `specifier` over a distribution
    that installed the imported TensorFlow."""
    assert _tensorflow_distributions(), "no distribution lists TensorFlow"
    return any(f'pip install "{name}{specifier}"' in message
               for name in _tensorflow_distributions())


# --- the ranges, and the checks in this process -------------------------------


def test_the_supported_ranges():
    assert (versions.TENSORFLOW.oldest, versions.TENSORFLOW.newest) == (
        (2, 16), (2, 21))
    assert versions.TENSORFLOW.specifier == _RANGE
    assert (versions.KERAS.oldest, versions.KERAS.newest) == (
        (3, 10), (3, 15))
    assert versions.KERAS.specifier == _KERAS_FLOOR
    assert versions.KERAS.tested_specifier == ">=3.10,<3.16"
    assert (versions.TF_KERAS.oldest, versions.TF_KERAS.newest) == (
        (2, 16), (2, 21))
    assert versions.TF_KERAS.specifier == _RANGE


@pytest.fixture
def release(monkeypatch):
    """`release(supported, version)` gives the installed module of
    `supported` another version string, then checks it; nothing has been
    warned about in this process, for the test's duration."""
    monkeypatch.setattr(versions, "_WARNED", set())

    def check(supported, version):
        module = importlib.import_module(supported.module)
        monkeypatch.setattr(module, "__version__", version)
        return versions.check(supported)

    return check


def _refusal(release, supported, version):
    with pytest.raises(ImportError) as error:
        release(supported, version)
    return str(error.value)


@pytest.mark.parametrize("version, newer", [
    ("2.16.0", False), ("2.16.2", False), ("2.18.1", False),
    ("2.21.0", False), ("2.21.0rc1", False), ("2.21.9rc0", False),
    ("2.17.0-rc0", False), ("2.22.0", True), ("2.22.0rc0", True),
    ("2.22.0-dev20250601", True), ("2.23.0.dev20261026", True),
    ("2.160.0", True), ("3.0.0", True),
])
def test_tensorflow_not_older_than_supported_passes(release, version, newer):
    assert (release(versions.TENSORFLOW, version) is not None) is newer


@pytest.mark.parametrize("version", [
    "2.15.1", "2.15.0", "1.15.5", "unknown",
])
def test_older_tensorflow_raises_import_error_saying_what_to_do(release,
                                                                 version):
    message = _refusal(release, versions.TENSORFLOW, version)
    assert message.startswith("tf_lossscale supports TensorFlow 2.16 to 2.21")
    assert f"this environment has TensorFlow {version}." in message
    _assert_explains(message, version)
    # The fix upgrades the distribution installed, not another beside it.
    assert _names_an_installed_tensorflow(message, _RANGE), message


@pytest.mark.parametrize("version, newer", [
    ("3.10.0", False), ("3.10.1rc0", False), ("3.15.1", False),
    ("3.16.0.dev2026102704", True), ("4.0.0", True),
])
def test_keras_from_the_floor_on_passes(release, version, newer):
    assert (release(versions.KERAS, version) is not None) is newer


@pytest.mark.parametrize("version", [
    "3.9.2", "3.0.5", "3.5.0", "2.15.0", "unknown",
])
def test_keras_below_the_floor_raises_import_error_saying_what_to_do(
        release, version):
    message = _refusal(release, versions.KERAS, version)
    assert f"this environment has Keras {version}." in message
    assert "Keras 3.10 and newer (tested: Keras 3.10 to 3.15)" in message
    assert f'pip install "keras{_KERAS_FLOOR}"' in message


@pytest.mark.parametrize("version, older", [
    ("2.15.1", True), ("2.16.0", False), ("2.21.0", False),
    ("2.23.0.dev2026102618", False), ("unknown", True),
])
def test_tf_keras_outside_its_extra_range_raises_when_older(release, version,
                                                            older):
    if older:
        message = _refusal(release, versions.TF_KERAS, version)
        assert f"has tf-keras {version}." in message
        assert f'pip install "tf-keras{_RANGE}"' in message
    else:
        release(versions.TF_KERAS, version)


def test_a_missing_tf_keras_raises_import_error_saying_what_to_install(
        monkeypatch):
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # Not importable.
    with pytest.raises(ImportError) as error:
        versions.check(versions.TF_KERAS)
    message = str(error.value)
    assert "but `import tf_keras` finds none." in message
    assert f'pip install "tf-keras{_RANGE}"' in message


def test_a_tensorflow_no_known_distribution_installed_gets_the_plain_line(
        tmp_path, monkeypatch):
    # A TensorFlow built from source, or installed by a distribution the
    # package does not know: the line names the plain one, and says so.
    unknown = types.ModuleType("tensorflow")
    unknown.__file__ = str(tmp_path / "tensorflow" / "__init__.py")
    unknown.__version__ = "2.15.0"
    monkeypatch.setitem(sys.modules, "tensorflow", unknown)
    with pytest.raises(ImportError) as error:
        versions.check(versions.TENSORFLOW)
    message = str(error.value)
    _assert_explains(message, "2.15.0")
    assert (f'pip install "tensorflow{_RANGE}"   # or the TensorFlow '
            "distribution you use") in message


def test_the_installed_releases_are_tested_ones():
    # What CI runs on: no warning, no error.
    assert versions.check(versions.TENSORFLOW) is None
    assert versions.check(versions.KERAS) is None
    assert versions.check(versions.TF_KERAS) is None


def _warned(newer):
    """The messages of the UntestedReleaseWarnings `warn_untested(newer)`
    gives, every filter aside."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.warn_untested(newer)
    return [str(w.message) for w in caught
            if w.category is versions.UntestedReleaseWarning]


def test_a_newer_tensorflow_warns_naming_the_range_and_the_installed_one(
        release):
    (message,) = _warned([release(versions.TENSORFLOW, "2.22.0")])
    assert message.startswith(
        "tf_lossscale is not tested with TensorFlow 2.22.0: it was tested "
        "with TensorFlow 2.16 to 2.21.")
    assert _names_an_installed_tensorflow(message, _RANGE), message
    assert "Keras" not in message


def test_a_newer_keras_warns_naming_the_range(release):
    (message,) = _warned([release(versions.KERAS, "3.16.0.dev2026102704")])
    assert ("not tested with Keras 3.16.0.dev2026102704: it was tested with "
            "Keras 3.10 to 3.15.") in message
    assert 'pip install "keras>=3.10,<3.16"' in message


def test_a_newer_tf_keras_warns_naming_the_range(release):
    (message,) = _warned([release(versions.TF_KERAS, "2.22.0")])
    assert message.startswith(
        "tf_lossscale is not tested with tf-keras 2.22.0: it was tested with "
        "tf-keras 2.16 to 2.21.")
    assert 'pip install "tf-keras>=2.16,<2.22"' in message


def test_one_warning_per_package_and_process(release):
    tensorflow = release(versions.TENSORFLOW, "2.22.0")
    keras = release(versions.KERAS, "3.17.0")
    assert len(_warned([tensorflow, None])) == 1
    assert _warned([tensorflow]) == []
    (message,) = _warned([tensorflow, keras, None])
    assert message.startswith(
        "tf_lossscale is not tested with Keras 3.17.0: it was tested with "
        "Keras 3.10 to 3.15.")
    assert _warned([tensorflow, keras]) == []


def test_the_warning_is_filtered_by_its_message(release):
    newer = [release(versions.TENSORFLOW, "2.22.0")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", "tf_lossscale is not tested with")
        versions.warn_untested(newer)
    assert caught == []


def test_the_warning_is_filtered_by_its_category_from_the_root(release):
    assert tf_lossscale.UntestedReleaseWarning is (
        versions.UntestedReleaseWarning)
    assert issubclass(tf_lossscale.UntestedReleaseWarning, UserWarning)
    newer = [release(versions.TF_KERAS, "2.22.0")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", tf_lossscale.UntestedReleaseWarning)
        with pytest.raises(tf_lossscale.UntestedReleaseWarning):
            versions.warn_untested(newer)


# --- `import tf_lossscale` against a stand-in TensorFlow, in a subprocess -----


def _import_tf_lossscale(*path_entries, flags=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*path_entries, _PACKAGE_ROOT] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run(
        [sys.executable, *flags, "-c", "import tf_lossscale"],
        capture_output=True, text=True, env=env, timeout=120, check=False)


def _fake_tensorflow(folder, version, distribution=None):
    """A `tensorflow` package of `version` in `folder`, optionally with the
    metadata of the pip distribution `distribution` that installed it."""
    package = folder / "tensorflow"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if distribution:
        dist_info = folder / (
            f"{distribution.replace('-', '_')}-{version}.dist-info")
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(textwrap.dedent(f"""\
            Metadata-Version: 2.1
            Name: {distribution}
            Version: {version}
            """))
        (dist_info / "RECORD").write_text(
            "tensorflow/__init__.py,,\n"
            f"{dist_info.name}/METADATA,,\n{dist_info.name}/RECORD,,\n")
    return str(folder)


def test_import_refuses_an_older_tensorflow_naming_its_distribution(tmp_path):
    result = _import_tf_lossscale(
        _fake_tensorflow(tmp_path, "2.15.1", "tensorflow-cpu"))
    assert result.returncode != 0
    assert "ImportError: tf_lossscale supports TensorFlow" in result.stderr
    _assert_explains(result.stderr, "2.15.1")
    assert f'pip install "tensorflow-cpu{_RANGE}"' in result.stderr


def test_import_without_tensorflow_says_how_to_install_one():
    # -S: no site-packages, so no TensorFlow; only tf_lossscale is on the path.
    result = _import_tf_lossscale(flags=["-S"])
    assert result.returncode != 0
    assert "ImportError: tf_lossscale supports TensorFlow" in result.stderr
    assert "`import tensorflow` finds none" in result.stderr
    _assert_explains(result.stderr, "")


def test_a_broken_tensorflow_install_is_not_reported_as_missing(tmp_path):
    package = tmp_path / "tensorflow"
    package.mkdir()
    (package / "__init__.py").write_text("import a_module_tensorflow_lost\n")
    result = _import_tf_lossscale(str(tmp_path))
    assert result.returncode != 0
    assert ("ModuleNotFoundError: No module named 'a_module_tensorflow_lost'"
            in result.stderr)
    assert "finds none" not in result.stderr


# --- `import tf_lossscale` with the real releases, in a subprocess ------------

# Runs the statements of argv[1] (a JSON list) one by one and prints, for
# each, the UntestedReleaseWarnings it gave and the exception it raised.
# `release(tensorflow=..., ...)` gives the installed modules other version
# strings (before the first statement: the tested ones, so that each run sees
# only the releases it sets); `wrap()` wraps a tf-keras optimizer. The
# process's warning filters stay as they are (PYTHONWARNINGS) until a
# statement changes them.
_STEPS = textwrap.dedent("""\
    import importlib, json, sys, warnings

    def release(**modules):
        for name, version in modules.items():
            importlib.import_module(name).__version__ = version

    def wrap():
        import tf_keras, tf_lossscale
        return tf_lossscale.LossScaleOptimizer(tf_keras.optimizers.SGD(0.1))

    release(**json.loads(sys.argv[2]))
    scope = {"release": release, "wrap": wrap, "warnings": warnings}
    reports = []
    with warnings.catch_warnings(record=True) as caught:
        for statement in json.loads(sys.argv[1]):
            error, seen = None, len(caught)
            try:
                exec(statement, scope)
            except Exception as raised:
                error = [type(raised).__name__, str(raised)]
            reports.append({"error": error, "warnings": [
                [str(w.message), w.filename] for w in caught[seen:]
                if w.category.__name__ == "UntestedReleaseWarning"]})
    print(json.dumps(reports))
    """)


def _run_steps(statements, **env):
    tested = {"tensorflow": "2.21.0", "keras": "3.15.1", "tf_keras": "2.21.0"}
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [_PACKAGE_ROOT] + ([environment["PYTHONPATH"]]
                           if environment.get("PYTHONPATH") else []))
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, json.dumps(statements),
         json.dumps(tested)], capture_output=True, text=True,
        env=environment, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_refuses_old_releases_and_warns_once_filtered_or_not(release):
    reports = _run_steps([
        "release(keras='3.9.2'); import tf_lossscale",
        # Filtered by its message before the import (PYTHONWARNINGS below).
        "release(keras='3.15.1', tensorflow='2.22.0'); import tf_lossscale",
        "warnings.simplefilter('always'); release(tf_keras='2.15.1'); wrap()",
        "release(tf_keras='2.22.0'); wrap()",
        "wrap()",
    ], PYTHONWARNINGS="ignore:tf_lossscale is not tested with")
    keras_too_old, newer_filtered, tf_keras_too_old, newer_tf_keras, again = (
        reports)
    assert keras_too_old == {"error": [
        "ImportError", _refusal(release, versions.KERAS, "3.9.2")],
                             "warnings": []}
    assert newer_filtered == {"error": None, "warnings": []}
    # The tf-keras wrapper checks tf-keras when it is first imported.
    assert tf_keras_too_old == {"error": [
        "ImportError", _refusal(release, versions.TF_KERAS, "2.15.1")],
                                "warnings": []}
    assert newer_tf_keras["error"] is None
    assert [message for message, _ in newer_tf_keras["warnings"]] == _warned(
        [release(versions.TF_KERAS, "2.22.0")])
    assert again == {"error": None, "warnings": []}


def test_everything_newer_gives_exactly_one_warning_per_process():
    # tf.keras is tf-keras: the import checks all three, in one warning;
    # wrapping and importing the tf-keras wrapper again add nothing.
    reports = _run_steps([
        "warnings.simplefilter('always'); release("
        "tensorflow='2.23.0.dev20261026', keras='3.17.0', "
        "tf_keras='2.23.0.dev2026102618'); import tf_lossscale",
        "wrap()",
        "import tf_lossscale.tf_keras.loss_scale_optimizer",
        "import keras; "
        "tf_lossscale.LossScaleOptimizer(keras.optimizers.SGD())",
        "from tf_lossscale._internal import versions; "
        "versions.warn_untested([versions.check(versions.KERAS)])",
    ], TF_USE_LEGACY_KERAS="1")
    assert [report["error"] for report in reports] == [None] * 5
    assert [len(report["warnings"]) for report in reports] == [1, 0, 0, 0, 0]
    message, filename = reports[0]["warnings"][0]
    assert ("not tested with TensorFlow 2.23.0.dev20261026 and Keras 3.17.0 "
            "and tf-keras 2.23.0.dev2026102618: it was tested with "
            "TensorFlow 2.16 to 2.21 and Keras 3.10 to 3.15 and tf-keras "
            "2.16 to 2.21.") in message
    # It points at the line that imported tf_lossscale.
    assert filename == "<string>"


# --- setup.py: no TensorFlow in install_requires, extras that bring one -------


def test_installing_the_package_installs_no_tensorflow():
    required = _setup_arguments()["install_requires"]
    names = {_requirement_name(r) for r in required}
    assert not {n for n in names if n.startswith(("tensorflow", "tf-", "tf_"))}


def test_installing_the_package_requires_keras_from_the_floor_on():
    # No upper bound: pip keeps a newer Keras, which imports with a warning.
    assert "keras" + _KERAS_FLOOR in _setup_arguments()["install_requires"]


def test_the_tf_keras_extras_name_its_range():
    extras = _setup_arguments()["extras_require"]
    assert extras["tf-keras"] == ["tf-keras" + _RANGE]
    assert "tf-keras" + _RANGE in extras["test"]


def test_extras_name_each_tensorflow_distribution_with_the_range():
    extras = _setup_arguments()["extras_require"]
    assert extras["tensorflow"] == ["tensorflow" + _RANGE]
    assert extras["tensorflow-cpu"] == ["tensorflow-cpu" + _RANGE]
    assert extras["and-cuda"] == ["tensorflow[and-cuda]" + _RANGE]
    assert extras["tensorboard"] == ["tensorboard" + _RANGE]


def test_the_test_extra_brings_the_full_tensorflow_distribution():
    test_extra = _setup_arguments()["extras_require"]["test"]
    assert "tensorflow" + _RANGE in test_extra
    assert not [r for r in test_extra if r.startswith("tensorflow-cpu")]
    assert {"pytest", "pytest-xdist", "matplotlib"} <= {_requirement_name(r)
                                        for r in test_extra}


def test_ci_installs_the_keras_hub_extra_the_test_extra_leaves_out():
    # keras-hub brings tensorflow-text, which has no wheels for some
    # platforms TensorFlow has: the test extra must install without it, and
    # CI installs it so that the model zoo's KerasHub tests run.
    extras = _setup_arguments()["extras_require"]
    assert [_requirement_name(r) for r in extras["keras-hub"]] == [
        "keras-hub"]
    assert "keras-hub" not in {_requirement_name(r) for r in extras["test"]}
    assert 'pip install --quiet -e ".[keras-hub]"' in (
        _ROOT / ".ci" / "run").read_text()


_MARKED = """
import sys
import pytest

class Marks:
    def pytest_collection_finish(self, session):
        for item in session.items:
            marked = item.get_closest_marker("at_scale") is not None
            print(f"{int(marked)} {item.nodeid}")

sys.exit(pytest.main(["--collect-only", "-q", "-n", "0", "-p",
                      "no:cacheprovider", "tests"], plugins=[Marks()]))
"""


def _at_scale_marks():
    """{test id: whether it is marked `at_scale`} of the whole suite, as
    pytest collects it without CI's PYTEST_ADDOPTS (one collection)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run([sys.executable, "-c", _MARKED], cwd=_ROOT, env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    marks = {}
    for line in done.stdout.splitlines():
        flag, _, test = line.partition(" ")
        if flag in ("0", "1") and "::" in test:
            marks[test] = flag == "1"
    return marks


def test_the_proofs_at_scale_are_the_zoo_and_the_benchmarks_run():
    # CI leaves the tests marked `at_scale` out with the oldest releases:
    # they must be the proofs on others' models and the benchmark's whole
    # run, and nothing that tests a release's API.
    marks = _at_scale_marks()
    at_scale = {test for test, marked in marks.items() if marked}
    zoo = {"tests/diagnosis/test_model_zoo.py",
           "tests/watch/test_zoo_late_failure.py"}
    assert {test.split("::")[0] for test in at_scale} == zoo | {
        "tests/tools/test_benchmark_quick.py",
        "tests/tools/test_hot_path_benchmark.py",
        "tests/tools/test_gradient_stats_benchmark.py"}
    # The zoo's files are proofs at scale throughout.
    assert not [test for test, marked in marks.items()
                if not marked and test.split("::")[0] in zoo]
    # Of the benchmark's, those that read its whole quick run (conftest's
    # `quick_benchmark`); those that build their own steps run with both.
    for test in at_scale - {t for t in at_scale if t.split("::")[0] in zoo}:
        assert "quick_section" in test or "test_benchmark_quick" in test, test
    assert not any("test_only_runs_the_sections_named" in test
                   or "test_every_form_gives_the_plain_forms" in test
                   for test in at_scale)
    script = (_ROOT / ".ci" / "run").read_text()
    assert "export PYTEST_ADDOPTS=\"-m 'not at_scale'\"" in script


# --- the README says the same --------------------------------------------------


def test_readme_states_the_supported_range():
    assert "TensorFlow 2.16–2.21" in _README


def test_readme_gives_an_install_line_for_each_case():
    assert "pip install tf_lossscale\n" in _README  # TensorFlow already there.
    for line in _EXTRA_LINES:
        assert line in _README


def test_readme_set_up_commands_install_a_tensorflow():
    """The two set-up commands work in a fresh environment: each installs
    the package with an extra that brings TensorFlow."""
    set_up = _README.split("## Set-up: two commands", 1)[1].split("\n## ")[0]
    commands = re.findall(r"```bash\n(.*?)\n```", set_up, re.DOTALL)
    assert len(commands) == 2, commands
    extras = _setup_arguments()["extras_require"]
    for command in commands:
        installed = re.match(r'pip install -e "\.\[([^\]]+)\]" && ', command)
        assert installed, command
        brought = {
            _requirement_name(requirement)
            for extra in installed.group(1).split(",")
            for requirement in extras[extra.strip()]
        }
        assert brought & {"tensorflow", "tensorflow-cpu"}, command


# --- CI runs both ends --------------------------------------------------------


def test_ci_runs_the_oldest_and_the_newest_releases_of_each_range():
    script = (_ROOT / ".ci" / "run").read_text()
    block = re.search(r"^releases=\(\n(.*?)^\)", script,
                      re.DOTALL | re.MULTILINE).group(1)
    runs = [line.strip().strip('"').split() for line in block.splitlines()]
    ranges = (versions.TENSORFLOW, versions.TF_KERAS,
              versions.KERAS)
    for run, end in ((runs[0], "oldest"), (runs[-1], "newest")):
        assert [versions.release_series(version) for version in run] == [
            getattr(supported, end) for supported in ranges], run


def test_readme_states_the_keras_range_and_what_ci_runs():
    assert "Keras 3.10 or newer (tested up to 3.15)" in _README
    assert ("TensorFlow\n2.16.2 with Keras 3.10.0, and TensorFlow 2.21.0 with "
            "Keras 3.15.1") in _README

"""The TensorFlow, Keras and tf-keras releases the package supports: what
setup.py declares, what `import tf_lossscale` checks, what README says.

setup.py names no TensorFlow in `install_requires` (installing the package
must never put a second TensorFlow distribution over the user's); extras
bring one. It requires Keras from the oldest supported release on.
`import tf_lossscale` refuses a missing TensorFlow, or a TensorFlow or Keras
older than supported, with an ImportError that says what to install, and
imports with one `UntestedReleaseWarning` when one is newer than tested;
tf-keras is checked the same way when the tf-keras wrapper is imported.

Older and missing TensorFlows run `import tf_lossscale` in a subprocess
against a stand-in `tensorflow` package (or none at all); these processes
never import the real TensorFlow, so they take well under a second each.
Newer releases, and Keras and tf-keras, run it in a subprocess whose real
TensorFlow, Keras or tf-keras is given another version string first.
"""

import json
import os
import pathlib
import re
import runpy
import subprocess
import sys
import textwrap
import types

import keras
import pytest
import tensorflow as tf
import tf_keras

from tests.support import paths
import tf_lossscale
from tf_lossscale._internal import versions as requirements

_ROOT = paths.ROOT
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
    captured = {}
    fake_setuptools = types.ModuleType("setuptools")
    fake_setuptools.setup = lambda **kwargs: captured.update(kwargs)
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


# --- the ranges and the version checks ---------------------------------------


def test_the_supported_ranges():
    assert (requirements.TENSORFLOW.oldest,
            requirements.TENSORFLOW.newest) == ((2, 16), (2, 21))
    assert requirements.TENSORFLOW.specifier == _RANGE
    assert (requirements.KERAS.oldest, requirements.KERAS.newest) == (
        (3, 10), (3, 15))
    assert requirements.KERAS.specifier == _KERAS_FLOOR
    assert requirements.KERAS.tested_specifier == ">=3.10,<3.16"
    assert (requirements.TF_KERAS.oldest, requirements.TF_KERAS.newest) == (
        (2, 16), (2, 21))
    assert requirements.TF_KERAS.specifier == _RANGE


@pytest.mark.parametrize("version", [
    "2.16.0", "2.16.2", "2.18.1", "2.21.0", "2.21.0rc1", "2.17.0-rc0",
    "2.22.0", "2.22.0-dev20250601", "2.160.0", "3.0.0",
])
def test_tensorflow_not_older_than_supported_passes(version):
    requirements.check_version(version)


@pytest.mark.parametrize("version, newer", [
    ("2.21.0", False), ("2.21.9rc0", False), ("2.22.0rc0", True),
    ("2.23.0.dev20261026", True), ("3.0.0", True), ("2.16.2", False),
])
def test_tensorflow_newer_than_tested(version, newer):
    assert requirements.TENSORFLOW.is_newer(version) is newer


@pytest.mark.parametrize("version", [
    "2.15.1", "2.15.0", "1.15.5", "unknown",
])
def test_older_tensorflow_raises_import_error_saying_what_to_do(version):
    with pytest.raises(ImportError) as error:
        requirements.check_version(version)
    _assert_explains(str(error.value), version)


def test_the_fix_names_the_distribution_the_user_has():
    with pytest.raises(ImportError) as error:
        requirements.check_version("2.15.1", "tensorflow-cpu")
    message = str(error.value)
    assert "'tensorflow-cpu' distribution" in message
    assert f'pip install "tensorflow-cpu{_RANGE}"' in message


@pytest.mark.parametrize("version", [
    "3.10.0", "3.10.1rc0", "3.15.1", "3.16.0.dev2026102704", "4.0.0",
])
def test_keras_from_the_floor_on_passes(version):
    requirements.check_keras_version(version)


@pytest.mark.parametrize("version", [
    "3.9.2", "3.0.5", "3.5.0", "2.15.0", "unknown",
])
def test_keras_below_the_floor_raises_import_error_saying_what_to_do(version):
    with pytest.raises(ImportError) as error:
        requirements.check_keras_version(version)
    message = str(error.value)
    assert f"this environment has Keras {version}." in message
    assert "Keras 3.10 and newer (tested: Keras 3.10 to 3.15)" in message
    assert f'pip install "keras{_KERAS_FLOOR}"' in message


@pytest.mark.parametrize("version, older", [
    ("2.15.1", True), ("2.16.0", False), ("2.21.0", False),
    ("2.23.0.dev2026102618", False), ("unknown", True),
])
def test_tf_keras_outside_its_extra_range_raises_when_older(version, older):
    if older:
        with pytest.raises(ImportError) as error:
            requirements.check_tf_keras_version(version)
        assert f"has tf-keras {version}." in str(error.value)
        assert f'pip install "tf-keras{_RANGE}"' in str(error.value)
    else:
        requirements.check_tf_keras_version(version)


def test_the_installed_releases_are_tested_ones():
    # What CI runs on: no warning, no error.
    assert requirements.check_tensorflow() is None
    assert requirements.check_keras() is None
    assert requirements.check_tf_keras() is None
    assert not requirements.TENSORFLOW.is_older(tf.__version__)
    assert not requirements.KERAS.is_older(keras.__version__)
    assert not requirements.TF_KERAS.is_older(tf_keras.__version__)


def test_the_installed_tensorflow_is_found_in_its_distribution():
    # Whichever distribution installed it here, its metadata lists the file.
    assert requirements.installed_distribution(tf.__file__) in (
        "tensorflow", "tensorflow-cpu", "tensorflow-intel")


# --- `import tf_lossscale` against another TensorFlow, in a subprocess ---------


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


def test_import_refuses_an_older_tensorflow(tmp_path):
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
    assert "ImportError: tf_lossscale needs TensorFlow" in result.stderr
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


# --- newer and older real releases, in a subprocess -------------------------

# Gives the installed modules the version strings of argv[1] (a JSON dict),
# imports tf_lossscale, runs the statements of argv[2:] one by one, and
# prints, after each (the import first), the UntestedReleaseWarnings given
# so far; an exception ends the run and is reported. With
# TF_LOSSSCALE_TEST_FILTERS=keep the process's warning filters stay as they
# are (PYTHONWARNINGS); otherwise every warning is recorded, repeats too.
_PATCHED_RUN = textwrap.dedent("""\
    import importlib, json, os, sys, warnings
    for name, version in json.loads(sys.argv[1]).items():
        importlib.import_module(name).__version__ = version
    report = {"after": [], "error": None}
    with warnings.catch_warnings(record=True) as caught:
        if os.environ.get("TF_LOSSSCALE_TEST_FILTERS") != "keep":
            warnings.simplefilter("always")
        try:
            for statement in ["import tf_lossscale"] + sys.argv[2:]:
                exec(statement)
                report["after"].append([
                    [w.category.__name__, str(w.message), w.filename]
                    for w in caught
                    if w.category.__name__ == "UntestedReleaseWarning"
                    or str(w.message).startswith("tf_lossscale is not")])
        except Exception as error:
            report["error"] = [type(error).__name__, str(error)]
    print(json.dumps(report))
    """)

_WRAP_TF_KERAS = ("tf_lossscale.LossScaleOptimizer("
                  "__import__('tf_keras').optimizers.SGD(0.1))")


# Tested releases: the versions every run gives the modules it does not
# name, so that each test sees only the releases it sets (a nightly run has
# untested ones installed).
_TESTED = {"tensorflow": "2.21.0", "keras": "3.15.1", "tf_keras": "2.21.0"}


def _patched_run(versions, *statements, **env):
    uses_tf_keras = "TF_USE_LEGACY_KERAS" in env or any(
        "tf_keras" in statement for statement in statements)
    versions = {**{name: version for name, version in _TESTED.items()
                   if name != "tf_keras" or uses_tf_keras}, **versions}
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [_PACKAGE_ROOT] + ([environment["PYTHONPATH"]]
                           if environment.get("PYTHONPATH") else []))
    done = subprocess.run(
        [sys.executable, "-c", _PATCHED_RUN, json.dumps(versions),
         *statements], capture_output=True, text=True, env=environment,
        timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_newer_tensorflow_imports_with_one_warning_naming_the_range():
    report = _patched_run({"tensorflow": "2.22.0"})
    assert report["error"] is None
    (warning,) = report["after"][0]
    category, message, filename = warning
    assert category == "UntestedReleaseWarning"
    assert message.startswith(
        "tf_lossscale is not tested with TensorFlow 2.22.0: it was tested "
        "with TensorFlow 2.16 to 2.21.")
    assert 'pip install "tensorflow>=2.16,<2.22"' in message
    assert "Keras" not in message
    # It points at the line that imported tf_lossscale.
    assert filename == "<string>"


def test_a_newer_keras_imports_with_one_warning_naming_the_range():
    report = _patched_run({"keras": "3.16.0.dev2026102704"},
                          "tf_lossscale.LossScaleOptimizer("
                          "__import__('keras').optimizers.SGD())")
    assert report["error"] is None
    assert len(report["after"][-1]) == 1
    message = report["after"][-1][0][1]
    assert ("not tested with Keras 3.16.0.dev2026102704: it was tested with "
            "Keras 3.10 to 3.15.") in message
    assert 'pip install "keras>=3.10,<3.16"' in message


def test_everything_newer_gives_exactly_one_warning_per_process():
    # tf.keras is tf-keras: the import checks all three, in one warning;
    # wrapping and importing the tf-keras wrapper again add nothing.
    report = _patched_run(
        {"tensorflow": "2.23.0.dev20261026", "keras": "3.17.0",
         "tf_keras": "2.23.0.dev2026102618"},
        _WRAP_TF_KERAS, "import tf_lossscale.tf_keras.loss_scale_optimizer",
        "tf_lossscale._internal.versions.warn_untested(["
        "tf_lossscale._internal.versions.check_keras()])",
        TF_USE_LEGACY_KERAS="1")
    assert report["error"] is None
    assert [len(seen) for seen in report["after"]] == [1, 1, 1, 1]
    message = report["after"][0][0][1]
    assert ("not tested with TensorFlow 2.23.0.dev20261026 and Keras 3.17.0 "
            "and tf-keras 2.23.0.dev2026102618: it was tested with "
            "TensorFlow 2.16 to 2.21 and Keras 3.10 to 3.15 and tf-keras "
            "2.16 to 2.21.") in message


def test_a_newer_tf_keras_warns_when_the_tf_keras_wrapper_is_imported():
    report = _patched_run({"tf_keras": "2.22.0"}, _WRAP_TF_KERAS,
                          _WRAP_TF_KERAS)
    assert report["error"] is None
    assert [len(seen) for seen in report["after"]] == [0, 1, 1]
    message = report["after"][1][0][1]
    assert message.startswith(
        "tf_lossscale is not tested with tf-keras 2.22.0: it was tested with "
        "tf-keras 2.16 to 2.21.")
    assert 'pip install "tf-keras>=2.16,<2.22"' in message


def test_the_warning_is_filtered_by_its_message_before_the_import():
    report = _patched_run(
        {"tensorflow": "2.22.0"}, TF_LOSSSCALE_TEST_FILTERS="keep",
        PYTHONWARNINGS="ignore:tf_lossscale is not tested with")
    assert report == {"after": [[]], "error": None}


def test_the_warning_is_filtered_by_its_category_after_the_import():
    report = _patched_run(
        {"tf_keras": "2.22.0"},
        "warnings.simplefilter('error', "
        "tf_lossscale._internal.versions.UntestedReleaseWarning)", _WRAP_TF_KERAS)
    assert report["error"][0] == "UntestedReleaseWarning"


def test_import_refuses_a_keras_below_the_floor():
    report = _patched_run({"keras": "3.9.2"})
    assert report["error"] == [
        "ImportError", requirements.old_keras_message("3.9.2")]
    assert "pip install \"keras>=3.10\"" in report["error"][1]


def test_the_tf_keras_wrapper_refuses_a_tf_keras_older_than_its_extra():
    report = _patched_run({"tf_keras": "2.15.1"}, _WRAP_TF_KERAS)
    assert report["error"] == [
        "ImportError", requirements.old_tf_keras_message("2.15.1")]
    assert len(report["after"]) == 1  # The import itself passed.


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
    assert {"pytest", "matplotlib"} <= {_requirement_name(r)
                                        for r in test_extra}


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
    ranges = (requirements.TENSORFLOW, requirements.TF_KERAS,
              requirements.KERAS)
    for run, end in ((runs[0], "oldest"), (runs[-1], "newest")):
        assert [requirements.release_series(version) for version in run] == [
            getattr(supported, end) for supported in ranges], run


def test_readme_states_the_keras_range_and_what_ci_runs():
    assert "Keras 3.10 or newer (tested up to 3.15)" in _README
    assert ("TensorFlow\n2.16.2 with Keras 3.10.0, and TensorFlow 2.21.0 with "
            "Keras 3.15.1") in _README

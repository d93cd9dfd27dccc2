"""TensorFlow as an optional dependency: extras, and the import-time check.

setup.py names no TensorFlow in `install_requires` (installing the package
must never put a second TensorFlow distribution over the user's); extras
bring one, and `import tf_lossscale` refuses a missing or out-of-range
TensorFlow with an ImportError that says what to install.

The out-of-range and missing cases run `import tf_lossscale` in a subprocess
against a stand-in `tensorflow` package (or none at all); these processes
never import the real TensorFlow, so they take well under a second each.
"""

import os
import pathlib
import re
import runpy
import subprocess
import sys
import textwrap
import types

import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale import tensorflow_requirement

_ROOT = pathlib.Path(__file__).parent.parent
_README = (_ROOT / "README.md").read_text()
_PACKAGE_ROOT = str(pathlib.Path(tf_lossscale.__file__).parent.parent)

_RANGE = ">=2.16,<2.22"
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


# --- the range and the version check -----------------------------------------


def test_the_supported_range_is_2_16_to_2_21():
    assert tensorflow_requirement.OLDEST == (2, 16)
    assert tensorflow_requirement.NEWEST == (2, 21)
    assert tensorflow_requirement.SPECIFIER == _RANGE


@pytest.mark.parametrize("version", [
    "2.16.0", "2.16.2", "2.18.1", "2.21.0", "2.21.0rc1", "2.17.0-rc0",
])
def test_versions_in_range_pass(version):
    tensorflow_requirement.check_version(version)


def test_the_installed_tensorflow_passes():
    assert tensorflow_requirement.is_supported(tf.__version__)
    tensorflow_requirement.check_version(tf.__version__)


@pytest.mark.parametrize("version", [
    "2.15.1", "2.15.0", "2.22.0", "2.22.0-dev20250601", "2.160.0", "1.15.5",
    "3.0.0", "unknown",
])
def test_versions_out_of_range_raise_import_error_saying_what_to_do(version):
    with pytest.raises(ImportError) as error:
        tensorflow_requirement.check_version(version)
    _assert_explains(str(error.value), version)


def test_the_fix_names_the_distribution_the_user_has():
    with pytest.raises(ImportError) as error:
        tensorflow_requirement.check_version("2.15.1", "tensorflow-cpu")
    message = str(error.value)
    assert "'tensorflow-cpu' distribution" in message
    assert f'pip install "tensorflow-cpu{_RANGE}"' in message


def test_the_installed_tensorflow_is_found_in_its_distribution():
    # Whichever distribution installed it here, its metadata lists the file.
    assert tensorflow_requirement.installed_distribution(tf.__file__) in (
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


def test_import_refuses_a_newer_tensorflow(tmp_path):
    result = _import_tf_lossscale(_fake_tensorflow(tmp_path, "2.22.0"))
    assert result.returncode != 0
    assert "ImportError: tf_lossscale supports TensorFlow" in result.stderr
    _assert_explains(result.stderr, "2.22.0")


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


# --- setup.py: no TensorFlow in install_requires, extras that bring one -------


def test_installing_the_package_installs_no_tensorflow():
    requirements = _setup_arguments()["install_requires"]
    names = {_requirement_name(r) for r in requirements}
    assert not {n for n in names if n.startswith(("tensorflow", "tf-", "tf_"))}


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

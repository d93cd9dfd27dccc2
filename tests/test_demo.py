"""Tests of the demo, `python -m tf_lossscale.demo`, the README's first command.

Two tests run the demo as a user does, in a subprocess (each costs a
TensorFlow import); the rest call its functions in this process, where
conftest.py has already split the CPU into logical devices.
"""

import importlib.resources
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_lossscale
from tf_lossscale import demo

_CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
_SUMMARY = re.compile(
    r"^final loss scale: (?P<scale>\S+), skipped steps: (?P<skipped>\d+), "
    r"weights finite: (?P<finite>True|False)$")
# Generous: other test processes share the two cores.
_SUBPROCESS_TIMEOUT_SECONDS = 600


def _run_demo(*flags):
    """Runs the demo module with `flags`, importing this tf_lossscale."""
    package_root = pathlib.Path(tf_lossscale.__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(package_root), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "tf_lossscale.demo", *flags],
        capture_output=True, text=True, env=env,
        timeout=_SUBPROCESS_TIMEOUT_SECONDS, check=False)


def _summary(stdout):
    last_line = stdout.strip().splitlines()[-1]
    match = _SUMMARY.match(last_line)
    assert match, f"last line is not the summary: {last_line!r}"
    return match


def test_readme_command_skips_exactly_the_injected_steps():
    result = _run_demo("--steps=30", "--num_devices=2",
                       "--inject_nonfinite_every=10")

    assert result.returncode == 0, result.stderr
    summary = _summary(result.stdout)
    assert summary["skipped"] == "3"
    assert summary["finite"] == "True"
    # Each skipped step lowered the dynamic scale from its initial value.
    initial = demo.load_config()["loss_scale"]["config"]["initial_loss_scale"]
    assert float(summary["scale"]) < initial
    # --steps counts optimizer steps: 30 = 27 applied + 3 skipped.
    assert "applied steps: 27," in result.stdout
    assert "skipped at steps: [10, 20, 30] (0 not injected)" in result.stdout
    assert "30/30" in result.stdout  # Keras' progress bar.


def test_bad_config_key_exits_nonzero_naming_the_key(tmp_path):
    config = demo.load_config()
    config["learning_rat"] = config.pop("learning_rate")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))

    result = _run_demo(f"--config={path}", "--steps=1")

    assert result.returncode != 0
    assert "'learning_rat'" in result.stderr
    assert "final loss scale" not in result.stdout


def test_run_without_injection_skips_nothing():
    config = demo.load_config()

    result = demo.run(config, num_devices=2, verbose=0)

    assert result.skipped_steps == 0
    assert result.applied_steps == config["steps"]
    assert result.weights_finite
    assert result.summary().endswith("skipped steps: 0, weights finite: True")
    # The dynamic scale never had reason to drop.
    assert result.final_loss_scale == (
        config["loss_scale"]["config"]["initial_loss_scale"])


def test_run_with_fixed_scale_applies_the_injected_nan():
    config = demo.load_config(_CONFIGS / "demo_fixed.json")

    result = demo.run(config, steps=2, inject_nonfinite_every=2, verbose=0)

    assert result.skipped_steps == 0
    assert result.applied_steps == 2
    assert not result.weights_finite


def test_injected_nan_reaches_only_the_last_replica():
    config = demo.load_config()
    features, labels = demo.synthetic_data(config)
    dataset = demo.training_dataset(features, labels, batch_size=8, steps=4,
                                    inject_nonfinite_every=2)
    strategy = demo.make_strategy(2)

    nan_per_replica = [
        [bool(np.isnan(x.numpy()).any())
         for x in strategy.experimental_local_results(batch_features)]
        for batch_features, _ in strategy.experimental_distribute_dataset(
            dataset)
    ]

    assert nan_per_replica == [[False, False], [False, True],
                               [False, False], [False, True]]


def _demo_configs():
    return sorted(_CONFIGS.glob("demo*.json"))


def test_configs_folder_has_the_default_demo_config():
    assert _CONFIGS / demo.DEFAULT_CONFIG in _demo_configs()


@pytest.mark.parametrize("path", _demo_configs(), ids=lambda p: p.name)
def test_shipped_demo_config_validates(path):
    config = demo.load_config(path)

    assert demo.validate_config(config) is config


def test_default_config_is_installed_package_data():
    installed = importlib.resources.files("tf_lossscale.configs")
    shipped = json.loads((_CONFIGS / demo.DEFAULT_CONFIG).read_text())

    assert (installed / demo.DEFAULT_CONFIG).is_file()
    assert demo.load_config() == shipped


@pytest.mark.parametrize("key, value", [
    ("batch_size", "64"),
    ("batch_size", 64.0),
    ("seed", True),
    ("num_classes", 1),
    ("learning_rate", 0),
    ("loss_scale", "static"),
    ("loss_scale", None),
    ("loss_scale", {"class_name": "DynamicLossScale",
                    "config": {"initial_loss_scale": -1.0}}),
    ("optimizer", "no_such_optimizer"),
    ("optimizer", {"class_name": "SGD", "config": {"learning_rate": 0.1}}),
])
def test_invalid_config_value_is_rejected_naming_its_key(key, value):
    config = demo.load_config()
    config[key] = value

    with pytest.raises(demo.ConfigError, match=f"'{key}'"):
        demo.validate_config(config)


def test_missing_config_key_is_rejected_naming_it():
    config = demo.load_config()
    del config["seed"]

    with pytest.raises(demo.ConfigError, match="'seed'"):
        demo.validate_config(config)


@pytest.mark.parametrize("identifier", ["dynamic", 128, 256.0])
def test_other_loss_scale_identifiers_are_accepted(identifier):
    config = demo.load_config()
    config["loss_scale"] = identifier

    assert demo.validate_config(config) is config

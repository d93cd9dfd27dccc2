"""Tests of the demo, `python -m tf_lossscale.demo`, the README's first command.

The command-line tests run the demo as a user does, each command line in a
process of its own, all forked from one that imported TensorFlow once
(tests/scripts/demo_command_lines.py); the rest call its functions and parse
its flags in this process, where conftest.py has already split the CPU into
logical devices.
"""

import dataclasses
import importlib.resources
import json
import re
import subprocess
import sys

from absl import flags
import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests.helpers import subprocesses
from tf_lossscale import demo
from tf_lossscale.demo import __main__ as command_line
from tf_lossscale.demo import training

pytestmark = pytest.mark.usefixtures("keras_isolation")

_CONFIGS = helpers.ROOT / "configs"
_SUMMARY = re.compile(
    r"^final loss scale: (?P<scale>\S+), skipped steps: (?P<skipped>\d+), "
    r"weights finite: (?P<finite>True|False)$")
_INITIAL_SCALE = demo.Config().loss_scale["config"]["initial_loss_scale"]
_KERAS_SERIES = tuple(int(part) for part in keras.__version__.split(".")[:2])
# The README's first command, and command lines the demo refuses: (flag,
# what stderr must say); "{bad_config}" stands for a config with a typo.
_README_COMMAND = ("--num_devices=2", "--log_skips")
_BAD_COMMANDS = [
    ("--plot=scale.jpg", "flag --plot=scale.jpg: must be a path ending in "
     ".png"),
    ("--steps=0", "flag --steps=0: must be an int >= 1"),
    ("--config={bad_config}", "error: unknown config key 'learning_rat'"),
    ("stray", "unexpected arguments: stray"),
]


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory):
    """{command line: its `subprocess.CompletedProcess`}: the demo run as a
    user runs it, without the extras, for the README's command and each of
    `_BAD_COMMANDS` (one xdist worker runs the tests that read it)."""
    config = dataclasses.asdict(demo.Config())
    config["learning_rat"] = config.pop("learning_rate")
    bad_config = tmp_path_factory.mktemp("demo") / "bad.json"
    bad_config.write_text(json.dumps(config))
    argvs = [list(_README_COMMAND)] + [
        [flag.format(bad_config=bad_config)] for flag, _ in _BAD_COMMANDS]
    results = subprocesses.run_json([
        str(helpers.SCRIPTS / "demo_command_lines.py"), json.dumps(argvs)])
    return {command: subprocess.CompletedProcess(argv, **result)
            for command, argv, result in zip(
                [_README_COMMAND] + [flag for flag, _ in _BAD_COMMANDS],
                argvs, results)}


def _summary(stdout):
    last_line = stdout.strip().splitlines()[-1]
    match = _SUMMARY.match(last_line)
    assert match, f"last line is not the summary: {last_line!r}"
    return match


def _is_calibration_then_more(skipped_at):
    """Skips at 1, 2, ..., k (calibrating down), then at least one later."""
    calibration = [step for index, step in enumerate(skipped_at, 1)
                   if step == index]
    return 0 < len(calibration) < len(skipped_at)


@pytest.mark.xdist_group("demo_command_lines")
def test_readme_command_overflows_organically_without_the_extras(
        command_lines):
    result = command_lines[_README_COMMAND]

    assert result.returncode == 0, result.stderr
    summary = _summary(result.stdout)
    skipped = int(summary["skipped"])
    assert skipped > 0
    assert summary["finite"] == "True"
    assert float(summary["scale"]) < _INITIAL_SCALE
    # No NaN was injected: every skip overflowed float16 on its own, and
    # the progress bar's float32 loss stayed finite.
    assert "injected non-finite steps: 0," in result.stdout
    assert f"({skipped} not injected)" in result.stdout
    assert "nan" not in result.stdout.lower()
    skipped_at = json.loads(
        re.search(r"skipped at steps: (\[[\d, ]*\])", result.stdout)[1])
    assert len(skipped_at) == skipped
    assert _is_calibration_then_more(skipped_at)
    # The progress bar's last update, after all 200 steps. Before Keras 3.15
    # the bar shows the epoch's average of every logged value, these too.
    progress_bar = result.stdout[result.stdout.rindex("200/200"):
                                 result.stdout.index("applied steps:")]
    if _KERAS_SERIES >= (3, 15):
        assert f"skipped_steps: {skipped}.0000" in progress_bar
        assert f"loss_scale: {float(summary['scale']):.4f}" in progress_bar
    else:
        assert "skipped_steps: " in progress_bar
        assert "loss_scale: " in progress_bar
    # --log_skips: the first skip names the variables that overflowed.
    first_skip = re.search(r"LossScaleMonitor: skipped step 1; .*"
                           r"non-finite gradients: (.*)", result.stdout)
    assert first_skip and "kernel" in first_skip[1], result.stdout


@pytest.mark.xdist_group("demo_command_lines")
@pytest.mark.parametrize("flag, expected", _BAD_COMMANDS)
def test_bad_flag_or_config_exits_nonzero_naming_it(command_lines, flag,
                                                    expected):
    result = command_lines[flag]

    assert result.returncode != 0
    assert expected in result.stderr, result.stderr
    assert "final loss scale" not in result.stdout


def test_default_run_calibrates_then_skips_only_at_overflows():
    result = demo.run(demo.Config(), steps=60, verbose=0)
    scales = result.loss_scales

    assert result.injected_at == ()
    assert _is_calibration_then_more(result.skipped_at)
    assert result.skipped_steps == len(result.skipped_at)
    assert result.applied_steps == 60 - result.skipped_steps
    assert result.weights_finite and np.isfinite(result.final_loss)
    assert len(scales) == 61 and scales[0] == _INITIAL_SCALE
    # A skip halves the scale; otherwise it stays or doubles (growth).
    for step in range(1, 61):
        if step in result.skipped_at:
            assert scales[step] == scales[step - 1] / 2
        else:
            assert scales[step] in (scales[step - 1], scales[step - 1] * 2)
    assert result.final_loss_scale == scales[-1]


def test_injected_nans_are_skipped_on_two_replicas():
    result = demo.run(demo.Config(), steps=30, num_devices=2,
                      inject_nonfinite_every=10, verbose=0)

    assert result.injected_at == (10, 20, 30)
    assert set(result.injected_at) <= set(result.skipped_at)
    assert result.weights_finite


def test_run_with_fixed_scale_applies_the_injected_nan():
    config = demo.Config.load(_CONFIGS / "demo_fixed.json")

    result = demo.run(config, steps=2, inject_nonfinite_every=2, verbose=0)

    assert result.skipped_steps == 0
    assert result.applied_steps == 2
    assert not result.weights_finite


def test_injected_nan_reaches_only_the_last_replica():
    features, labels = training.synthetic_data(demo.Config())
    dataset = training.training_dataset(features, labels, batch_size=8,
                                        steps=4, inject_nonfinite_every=2)
    strategy = training.make_strategy(2)

    nan_per_replica = [
        [bool(np.isnan(x.numpy()).any())
         for x in strategy.experimental_local_results(batch_features)]
        for batch_features, _ in strategy.experimental_distribute_dataset(
            dataset)
    ]

    assert nan_per_replica == [[False, False], [False, True],
                               [False, False], [False, True]]


# --plot and --logdir.


def test_plot_and_logdir_write_a_png_and_the_scalars(tmp_path):
    plot = tmp_path / "plots" / "scale.png"

    result = demo.run(demo.Config(), steps=12, verbose=0,
                      logdir=tmp_path / "tb", plot=plot)

    image = plot.read_bytes()
    assert image.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = int.from_bytes(image[16:20], "big"), int.from_bytes(
        image[20:24], "big")
    assert (width, height) == (800, 360)
    scalars = {}
    for path in tf.io.gfile.glob(str(tmp_path / "tb/train/events.out.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    float(tf.make_ndarray(value.tensor)))
    assert scalars["batch_loss_scale"] == list(result.loss_scales[1:])
    assert scalars["batch_skipped_steps"] == [
        sum(1 for s in result.skipped_at if s <= step)
        for step in range(1, 13)]
    assert len(scalars["batch_loss"]) == 12
    assert np.isfinite(scalars["batch_loss"]).all()


@pytest.mark.parametrize("option, package, extra", [
    ("plot", "matplotlib", "plot"),
    ("logdir", "tensorboard", "tensorboard"),
])
def test_missing_extra_fails_before_training_saying_what_to_install(
        tmp_path, monkeypatch, capsys, option, package, extra):
    monkeypatch.setitem(sys.modules, package, None)
    path = tmp_path / ("out.png" if option == "plot" else "logs")

    with pytest.raises(demo.MissingExtraError) as error:
        demo.run(demo.Config(), steps=1, **{option: path})

    assert f"--{option} needs {package}" in str(error.value)
    assert f'pip install "tf_lossscale[{extra}]"' in str(error.value)
    assert f'pip install -e ".[{extra}]"' in str(error.value)
    assert capsys.readouterr().out == ""  # No progress bar: no training.
    assert not path.exists()


# Configs and options.


def test_shipped_demo_json_spells_out_the_defaults():
    assert json.loads((_CONFIGS / "demo.json").read_text()) == (
        dataclasses.asdict(demo.Config()))


@pytest.mark.parametrize("path", sorted(_CONFIGS.glob("demo*.json")),
                         ids=lambda p: p.name)
def test_shipped_demo_config_loads(path):
    config = demo.Config.load(path)

    assert dataclasses.asdict(config) == {
        **dataclasses.asdict(demo.Config()), **json.loads(path.read_text())}


def test_demo_configs_are_installed_package_data():
    # The installed copy may come from another checkout than this one (an
    # editable install elsewhere), so only the files' presence is compared.
    installed = importlib.resources.files("tf_lossscale.configs")

    assert (installed / "demo.json").is_file()
    assert (installed / "demo_fixed.json").is_file()


def test_missing_keys_take_their_defaults(tmp_path):
    path = tmp_path / "seed.json"
    path.write_text('{"seed": 3}')

    assert demo.Config.load(path) == demo.Config(seed=3)
    assert dataclasses.asdict(demo.Config(seed=3)) == {
        **dataclasses.asdict(demo.Config()), "seed": 3}


_LOSS_SCALE_KIND = "a tf_lossscale.get identifier: a number, 'dynamic' or "
_OPTIMIZER_KIND = "a Keras optimizer name or {'class_name': ..., "


@pytest.mark.parametrize("key, value, kind", [
    ("batch_size", "64", "an int >= 1"),
    ("batch_size", 64.0, "an int >= 1"),
    ("seed", True, "an int >= 0"),
    ("steps", 0, "an int >= 1"),
    ("num_classes", 1, "an int >= 2"),
    ("learning_rate", 0, "a number > 0"),
    ("learning_rate", True, "a number > 0"),
    ("learning_rate", float("inf"), "a number > 0"),
    ("loss_scale", "static", _LOSS_SCALE_KIND),
    ("loss_scale", None, _LOSS_SCALE_KIND),
    ("loss_scale", {"class_name": "DynamicLossScale",
                    "config": {"initial_loss_scale": -1.0}}, _LOSS_SCALE_KIND),
    ("optimizer", "no_such_optimizer", _OPTIMIZER_KIND),
    ("optimizer", 3, _OPTIMIZER_KIND),
    ("optimizer", {"class_name": "SGD", "config": {"learning_rate": 0.1}},
     _OPTIMIZER_KIND),
])
def test_invalid_config_value_is_rejected_naming_key_and_value(
        tmp_path, key, value, kind):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({key: value}))

    with pytest.raises(demo.ConfigError) as error:
        demo.Config(**{key: value})
    message = str(error.value)

    assert message.startswith(f"config key {key!r} must be {kind}")
    assert f", got {value!r}" in message
    with pytest.raises(demo.ConfigError, match=re.escape(message)):
        demo.Config.load(path)


def test_unknown_config_key_is_rejected_naming_it(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text('{"sed": 3}')

    with pytest.raises(demo.ConfigError, match="unknown config key 'sed'"):
        demo.Config.load(path)


def _parsed_flags(*argv):
    values = flags.FlagValues()
    command_line.define_flags(values)
    values(["demo", *argv])
    return values


def test_flags_default_to_a_plain_run_of_the_config():
    values = _parsed_flags()

    assert {name: values[name].value for name in values} == {
        "config": None, "steps": None, "num_devices": 1,
        "inject_nonfinite_every": 0, "logdir": None, "plot": None,
        "log_skips": False}


@pytest.mark.parametrize("flag, reason", [
    ("--steps=0", "must be an int >= 1"),
    ("--steps=2.0", ""),  # Not an integer flag's value.
    ("--num_devices=0", "must be an int >= 1"),
    ("--inject_nonfinite_every=-1", "must be an int >= 0"),
    ("--plot=scale.jpg", "must be a path ending in .png"),
    ("--log_skips=yes", ""),  # Not a bool flag's value.
])
def test_invalid_flag_is_rejected_naming_it(flag, reason):
    # A value of the flag's type gets the check `run` makes (below).
    with pytest.raises(flags.Error,
                       match=f"^flag {re.escape(flag)}: {re.escape(reason)}"):
        _parsed_flags(flag)


@pytest.mark.parametrize("option, value, kind", [
    ("steps", 0, "an int >= 1"),
    ("steps", 2.0, "an int >= 1"),
    ("num_devices", 0, "an int >= 1"),
    ("inject_nonfinite_every", -1, "an int >= 0"),
    ("logdir", ["runs"], "a path"),
    ("plot", "scale.jpg", "a path ending in .png"),
    ("plot", 3, "a path ending in .png"),
    ("log_skips", "yes", "a bool"),
])
def test_invalid_option_of_run_is_rejected_before_training(option, value,
                                                           kind, capsys):
    with pytest.raises(demo.ConfigError) as error:
        demo.run(demo.Config(), **{option: value})

    assert str(error.value) == f"{option} must be {kind}, got {value!r}"
    assert capsys.readouterr().out == ""  # No progress bar: no training.


def test_run_takes_only_a_config():
    with pytest.raises(demo.ConfigError, match=re.escape(
            "config must be a tf_lossscale.demo.Config, got {'steps': 3}")):
        demo.run({"steps": 3})


@pytest.mark.parametrize("identifier", ["dynamic", 128, 256.0])
def test_other_loss_scale_identifiers_are_accepted(identifier):
    assert demo.Config(loss_scale=identifier).loss_scale == identifier


def test_importing_the_demo_registers_no_command_line_flags():
    # The flags belong to `python -m tf_lossscale.demo`: a program that
    # imports the demo (or anything that imports it) keeps absl's global
    # flags to itself. This module imported the demo's every module.
    assert set(_parsed_flags()).isdisjoint(flags.FLAGS)

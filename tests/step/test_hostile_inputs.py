"""Hostile and careless inputs: each refused early with the right exception,
naming the field, in a message of bounded length, changing nothing.

1. Messages: every entry point, given each of `hostile_values.HOSTILE`,
   raises a TypeError or ValueError shorter than `MESSAGE_BOUND`.
2. Constructor arguments, each at its own type and range edges
   (`hostile_values.py`): `FixedLossScale`, `DynamicLossScale`,
   `LossScaleOptimizer` (Keras 3 here; tf-keras, both optimizer kinds, in
   the session's tf-keras process, `hostile_tf_keras_worker.py`),
   the TF1 wrapper and `LossScaleMonitor`: the exception, the argument and
   the value in the message, and no variable created.
3. Configs and `.keras` files: `deserialize`, `get` and the wrappers'
   `from_config`; `.keras` files crafted here in `tmp_path` and loaded in
   safe mode, importing and running nothing outside the package.
4. Call-time arguments: what every wrapper's `apply_gradients` (and Keras
   3's `apply`, `scale_loss`, the TF 2.x protocol) gets, eagerly, in a
   `tf.function` and under XLA: the same exception from each wrapper, and
   every variable (weights, slots, the scale's state, counters) unchanged.
5. Threads: eager updates of one `DynamicLossScale` from several threads.
"""

import copy
import io
import json
import os
import re
import sys
import threading
import traceback
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.helpers import hostile_values
from tests.helpers.hostile_values import MESSAGE_BOUND
import tf_lossscale
from tf_lossscale._internal import checks
from tf_lossscale.compat.v1 import MixedPrecisionLossScaleOptimizer
from tf_lossscale.tf_keras import loss_scale_optimizer as tf_keras_optimizer

pytestmark = pytest.mark.usefixtures("keras_isolation")

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(tf_lossscale.__file__))
_PACKAGE_DIR = os.path.dirname(tf_lossscale.__file__)
# Bounds for a hung process, not speed requirements.
_TIMEOUT_SECONDS = 600


def _assert_refused(error, expected, names, message=None, shows=None):
    """`error` is an `expected`, its message names each of `names` (and holds
    `shows`) and is shorter than MESSAGE_BOUND."""
    assert isinstance(error, expected), (
        f"expected {expected}, got {type(error).__name__}: "
        f"{str(error)[:500]}")
    message = str(error) if message is None else message
    assert len(message) < MESSAGE_BOUND, (len(message), message[:1000])
    for name in names:
        assert re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message), (
            name, message)
    assert shows is None or shows in message, (shows, message)


def _ids(cases):
    return [hostile_values.case_id(case) for case in cases]


def _failures(results):
    """The labels of `{label: thunk}` whose assertions fail, with why."""
    failed = {}
    for label, check in results.items():
        try:
            check()
        except AssertionError as error:
            failed[label] = str(error)[:300]
    return failed


# ---------------------------------------------------------------------------
# 1. Messages, against every hostile value.


def _sgd():
    return keras.optimizers.SGD(0.1)


_LSO = tf_lossscale.LossScaleOptimizer
_ENTRY_POINTS = {
    "FixedLossScale": tf_lossscale.FixedLossScale,
    "DynamicLossScale(increment_period)": lambda v: (
        tf_lossscale.DynamicLossScale(increment_period=v)),
    "DynamicLossScale(consecutive_hysteresis)": lambda v: (
        tf_lossscale.DynamicLossScale(consecutive_hysteresis=v)),
    "DynamicLossScale(on_min_loss_scale)": lambda v: (
        tf_lossscale.DynamicLossScale(on_min_loss_scale=v)),
    "get": tf_lossscale.get,
    "deserialize": tf_lossscale.deserialize,
    "deserialize(custom_objects)": lambda v: tf_lossscale.deserialize(
        {"class_name": "FixedLossScale", "config": {"loss_scale_value": 2}},
        custom_objects=v),
    "LossScaleOptimizer(inner_optimizer)": _LSO,
    "LossScaleOptimizer(loss_scale)": lambda v: _LSO(_sgd(), loss_scale=v),
    "LossScaleOptimizer(name)": lambda v: _LSO(_sgd(), name=v),
    "LossScaleOptimizer(initial_scale)": lambda v: _LSO(
        _sgd(), initial_scale=v),
    "LossScaleOptimizer(dynamic)": lambda v: _LSO(_sgd(), dynamic=v),
    "LossScaleOptimizer(clipnorm)": lambda v: _LSO(_sgd(), clipnorm=v),
    "LossScaleOptimizer.from_config": _LSO.from_config,
    "LossScaleOptimizer.from_config(inner_optimizer)": lambda v: (
        _LSO.from_config({"inner_optimizer": v})),
    "LossScaleMonitor(verbose)": lambda v: tf_lossscale.LossScaleMonitor(
        verbose=v),
    "MixedPrecisionLossScaleOptimizer(opt)": MixedPrecisionLossScaleOptimizer,
}
# (entry point, hostile value) pairs where the value is valid.
_VALID = {("LossScaleOptimizer(name)", "million_char_str"),
          ("deserialize(custom_objects)", "dict_5000_deep"),
          ("deserialize(custom_objects)", "100000_keys")}


@pytest.mark.parametrize("label", sorted(hostile_values.HOSTILE))
def test_every_entry_point_bounds_its_message(keras3_wrapper, label):
    value = hostile_values.HOSTILE[label]()
    text = checks.summary(value)
    assert len(text) <= checks.SUMMARY_CHARS + 50, text[:1000]
    step = keras3_wrapper.optimizer.apply_gradients
    kernel = keras3_wrapper.kernel
    entry_points = {
        **_ENTRY_POINTS,
        "apply_gradients(grads_and_vars)": step,
        "apply_gradients(gradient)": lambda v: step([(v, kernel)]),
        "apply_gradients(variable)": lambda v: step([(tf.ones(2), v)]),
    }

    def check(entry):
        error, _ = hostile_values.attempt(lambda: entry_points[entry](value))
        if (entry, label) not in _VALID:
            _assert_refused(error, (TypeError, ValueError), [])

    assert not _failures({entry: lambda e=entry: check(e)
                          for entry in entry_points})


def test_an_int_too_long_to_write_is_described_by_its_size_at_any_depth():
    bits = (10**5000).bit_length()
    assert checks.summary(10**5000) == f"<int of {bits} bits>"
    assert checks.summary([1, {"k": -10**5000}]) == (
        f"[1, {{'k': <-int of {bits} bits>}}]")


# ---------------------------------------------------------------------------
# 2. Constructor arguments, at their type and range edges.


def _assert_case_refused(case, error, created, value):
    shows = checks.summary(value) if case.shows_value else None
    _assert_refused(error, case.error, [case.argument], shows=shows)
    assert not created, created


@pytest.mark.parametrize("case", hostile_values.FIXED_LOSS_SCALE,
                         ids=_ids(hostile_values.FIXED_LOSS_SCALE))
def test_fixed_loss_scale_refuses(case):
    value = case.make(keras)
    kwargs = {"loss_scale_value": 2.0, case.argument: value}
    error, created = hostile_values.attempt(
        lambda: tf_lossscale.FixedLossScale(**kwargs))
    _assert_case_refused(case, error, created, value)


@pytest.mark.parametrize("case", hostile_values.DYNAMIC_LOSS_SCALE,
                         ids=_ids(hostile_values.DYNAMIC_LOSS_SCALE))
def test_dynamic_loss_scale_refuses(case):
    value = case.make(keras)
    error, created = hostile_values.attempt(
        lambda: tf_lossscale.DynamicLossScale(**{case.argument: value}))
    _assert_case_refused(case, error, created, value)


_OPTIMIZER_CASES = hostile_values.OPTIMIZER + [hostile_values.ALREADY_WRAPPED]


@pytest.mark.parametrize("case", _OPTIMIZER_CASES, ids=_ids(_OPTIMIZER_CASES))
def test_keras_optimizer_refuses(case):
    inner = keras.optimizers.SGD(0.1)
    value = case.make(keras)
    if case.argument == "inner_optimizer":
        error, created = hostile_values.attempt(
            lambda: tf_lossscale.LossScaleOptimizer(value))
    else:
        error, created = hostile_values.attempt(
            lambda: tf_lossscale.LossScaleOptimizer(
                inner, **{case.argument: value}))
    _assert_case_refused(case, error, created, value)
    # The refused wrapper did not claim the inner optimizer.
    tf_lossscale.LossScaleOptimizer(inner)


@pytest.mark.parametrize("case", hostile_values.MONITOR,
                         ids=_ids(hostile_values.MONITOR))
def test_monitor_refuses(case):
    value = case.make(keras)
    error, created = hostile_values.attempt(
        lambda: tf_lossscale.LossScaleMonitor(**{case.argument: value}))
    _assert_case_refused(case, error, created, value)


@pytest.mark.parametrize("case", hostile_values.TF1_OPTIMIZER,
                         ids=_ids(hostile_values.TF1_OPTIMIZER))
def test_tf1_optimizer_refuses(case):
    value = case.make(keras)
    inner = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    arguments = {"opt": inner, "loss_scale": "dynamic", case.argument: value}
    error, created = hostile_values.attempt(
        lambda: MixedPrecisionLossScaleOptimizer(**arguments))
    _assert_case_refused(case, error, created, value)


@pytest.fixture(scope="module")
def tf_keras_results(tf_keras_interpreter):
    return tf_keras_interpreter.call(
        "tests.scripts.hostile_tf_keras_worker:results")


_TF_KERAS_CASES = {"optimizer": _OPTIMIZER_CASES, "legacy": _OPTIMIZER_CASES,
                   "monitor": hostile_values.MONITOR}


@pytest.mark.parametrize("kind", sorted(_TF_KERAS_CASES))
def test_tf_keras_optimizer_and_monitor_refuse(tf_keras_results, kind):
    cases = {hostile_values.case_id(case): case
             for case in _TF_KERAS_CASES[kind]}
    results = tf_keras_results[kind]
    assert sorted(results) == sorted(cases)

    def check(key):
        case, result = cases[key], results[key]
        assert case.error.__name__ in (result["error"] or []), result
        assert result["length"] < MESSAGE_BOUND, result
        assert re.search(rf"\b{case.argument}\b", result["message"]), result
        assert not case.shows_value or result["summary"] in result[
            "message"], result
        assert not result["created"], result
        assert result["inner_reusable"], result

    assert not _failures({key: lambda k=key: check(k) for key in cases})


# ---------------------------------------------------------------------------
# 3. Configs and .keras files.


def _serialized_sgd():
    return keras.optimizers.serialize(keras.optimizers.SGD(0.1))


_LOSS_SCALE_CONFIGS = {
    # label: (config, exception, the names the message must hold)
    "class_name_list": ({"class_name": ["x"], "config": {}}, TypeError,
                        ["class_name"]),
    "class_name_dict": ({"class_name": {"x": 1}, "config": {}}, TypeError,
                        ["class_name"]),
    "class_name_none": ({"class_name": None, "config": {}}, TypeError,
                        ["class_name"]),
    "class_name_million_chars": (
        {"class_name": "x" * 10**6, "config": {}}, ValueError,
        ["class_name"]),
    "nested_5000_deep": (hostile_values.nested_dict(), ValueError,
                         ["class_name", "config"]),
    "arguments_nested_5000_deep": (
        {"class_name": "FixedLossScale",
         "config": hostile_values.nested_dict()}, TypeError, ["config"]),
    "value_nested_5000_deep": (
        {"class_name": "FixedLossScale",
         "config": {"loss_scale_value": hostile_values.nested_dict()}},
        TypeError, ["loss_scale_value"]),
    "value_million_element_list": (
        {"class_name": "DynamicLossScale",
         "config": {"initial_loss_scale": [1.0] * 10**6}}, TypeError,
        ["initial_loss_scale"]),
    "argument_name_million_chars": (
        {"class_name": "FixedLossScale", "config": {"x" * 10**6: 2.0}},
        TypeError, ["config"]),
    "argument_name_int": (
        {"class_name": "FixedLossScale", "config": {1: 2.0}}, TypeError,
        ["config"]),
    "arguments_list": ({"class_name": "FixedLossScale", "config": [2.0]},
                       TypeError, ["config"]),
    "100000_keys": ({str(i): i for i in range(10**5)}, ValueError,
                    ["class_name", "config"]),
}


@pytest.mark.parametrize("entry", ["deserialize", "get",
                                   "LossScaleOptimizer.from_config"])
def test_malformed_loss_scale_config_is_refused_naming_the_part(entry):

    def check(label):
        config, expected, names = _LOSS_SCALE_CONFIGS[label]
        if entry == "LossScaleOptimizer.from_config":
            names = ["loss_scale"] + names
            make = lambda: tf_lossscale.LossScaleOptimizer.from_config({  # pylint: disable=g-long-lambda
                "name": "lso", "inner_optimizer": _serialized_sgd(),
                "loss_scale": config})
        else:
            make = lambda: getattr(tf_lossscale, entry)(config)
        error, created = hostile_values.attempt(make)
        _assert_refused(error, expected, names)
        # from_config builds the inner optimizer (its own variables) before
        # the wrapper's arguments are checked; no loss-scale variable.
        assert not set(created) & {"current_loss_scale", "good_steps"}

    assert not _failures({label: lambda l=label: check(l)
                          for label in _LOSS_SCALE_CONFIGS})


def test_custom_objects_that_is_not_a_dict_is_refused():
    config = tf_lossscale.serialize(tf_lossscale.FixedLossScale(2))
    for custom_objects in (["FixedLossScale"], "FixedLossScale", ("x",), 3,
                           [tf_lossscale.FixedLossScale] * 10**6):
        error, _ = hostile_values.attempt(lambda: tf_lossscale.deserialize(
            config, custom_objects=custom_objects))  # pylint: disable=cell-var-from-loop
        _assert_refused(error, TypeError, ["custom_objects"])
        error, _ = hostile_values.attempt(
            lambda: tf_lossscale.LossScaleOptimizer.from_config(  # pylint: disable=g-long-lambda
                {"inner_optimizer": _serialized_sgd()},
                custom_objects=custom_objects))  # pylint: disable=cell-var-from-loop
        _assert_refused(error, TypeError, ["custom_objects"])


_INNER_OPTIMIZER_CONFIGS = {
    "null": None,
    "int": 3,
    "str": "adam",
    "list": [_serialized_sgd],
    "empty_dict": {},
    "class_name_list": {"class_name": ["SGD"], "config": {}},
    "class_name_int": {"class_name": 3, "config": {}},
    "config_int": {"class_name": "SGD", "config": 3},
    "nested_5000_deep": hostile_values.nested_dict(),
    "million_element_list": [1.0] * 10**6,
}
_FROM_CONFIG = {
    "keras3": tf_lossscale.LossScaleOptimizer.from_config,
    "tf_keras": tf_keras_optimizer.LossScaleOptimizer.from_config,
    "tf_keras_legacy": tf_keras_optimizer.LegacyLossScaleOptimizer.from_config,
}


@pytest.mark.parametrize("key", ["inner_optimizer", "optimizer"])
@pytest.mark.parametrize("wrapper", sorted(_FROM_CONFIG))
def test_inner_optimizer_that_is_no_serialized_optimizer_is_refused(
        wrapper, key):
    # "optimizer" is where TF <= 2.3 configs kept it.

    def check(label):
        config = {key: _INNER_OPTIMIZER_CONFIGS[label],
                  "loss_scale": {"class_name": "FixedLossScale",
                                 "config": {"loss_scale_value": 2.0}}}
        error, created = hostile_values.attempt(
            lambda: _FROM_CONFIG[wrapper](config))
        _assert_refused(error, TypeError, [key])
        assert not created

    assert not _failures({label: lambda l=label: check(l)
                          for label in _INNER_OPTIMIZER_CONFIGS})


@pytest.mark.parametrize("wrapper", sorted(_FROM_CONFIG))
def test_optimizer_config_of_the_wrong_shape_is_refused(wrapper):
    for config, expected, names in [
            (None, TypeError, ["config"]),
            ([{"inner_optimizer": None}] * 10**6, TypeError, ["config"]),
            ({1: 2, "inner_optimizer": None}, TypeError, ["keys"]),
            ({"inner_optimizer": None, "x" * 10**6: 1}, TypeError,
             ["inner_optimizer"]),
            ({"name": "lso"}, ValueError, ["inner_optimizer"])]:
        error, _ = hostile_values.attempt(
            lambda: _FROM_CONFIG[wrapper](config))  # pylint: disable=cell-var-from-loop
        _assert_refused(error, expected, names)


def test_unknown_config_key_is_refused_briefly_by_the_constructor():
    config = {"inner_optimizer": _serialized_sgd(), "x" * 10**6: 1}
    error, _ = hostile_values.attempt(
        lambda: tf_lossscale.LossScaleOptimizer.from_config(config))
    _assert_refused(error, TypeError, ["unexpected argument"])


def _our_error(error):
    """The exception tf_lossscale raised, where Keras re-raised it with its
    own message (TypeErrors in from_config) or raised it as it was."""
    seen = error
    while seen is not None:
        frames = traceback.extract_tb(seen.__traceback__)
        if frames and frames[-1].filename.startswith(_PACKAGE_DIR):
            return seen
        seen = seen.__cause__ or seen.__context__
    raise AssertionError(f"no tf_lossscale error in the chain of {error!r}")


@pytest.fixture(scope="module")
def saved_model_file(tmp_path_factory):
    """A small model compiled with the wrapper, saved as `.keras`."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=tf_lossscale.LossScaleOptimizer(
        keras.optimizers.SGD(0.1)), loss="mse")
    path = tmp_path_factory.mktemp("saved") / "model.keras"
    model.save(path)
    return path


def _crafted(saved, path, edit_optimizer_config):
    """A copy of the `.keras` file `saved` at `path`, its config.json's
    optimizer config changed by `edit_optimizer_config`."""
    with zipfile.ZipFile(saved) as source:
        members = {name: source.read(name) for name in source.namelist()}
    config = json.loads(members["config.json"])
    edit_optimizer_config(config["compile_config"]["optimizer"]["config"])
    members["config.json"] = json.dumps(config)
    with zipfile.ZipFile(path, "w") as target:
        for name, data in members.items():
            target.writestr(name, data)
    return path


def _set(key, value):
    return lambda config: config.__setitem__(key, value)


def _set_loss_scale(key, value):
    return lambda config: config["loss_scale"].__setitem__(key, value)


_CRAFTED_FILES = {
    "class_name_list": (_set_loss_scale("class_name", ["x"]), TypeError,
                        ["class_name"]),
    "class_name_dict": (_set_loss_scale("class_name", {"x": 1}), TypeError,
                        ["class_name"]),
    "inner_optimizer_null": (_set("inner_optimizer", None), TypeError,
                             ["inner_optimizer"]),
    "inner_optimizer_list": (_set("inner_optimizer", [1, 2]), TypeError,
                             ["inner_optimizer"]),
    # JSON itself stops at about 1,000 levels; 500 reach tf_lossscale.
    "loss_scale_nested_500_deep": (
        _set("loss_scale", hostile_values.nested_dict(500)), ValueError,
        ["class_name", "config"]),
    "loss_scale_million_element_list": (
        _set_loss_scale("config", {"initial_loss_scale": [1.0] * 10**6}),
        TypeError, ["initial_loss_scale"]),
}


def test_crafted_keras_file_is_refused_naming_the_field(saved_model_file,
                                                        tmp_path):

    def check(label):
        edit, expected, names = _CRAFTED_FILES[label]
        path = _crafted(saved_model_file, tmp_path / f"{label}.keras", edit)
        with pytest.raises((TypeError, ValueError)) as raised:
            keras.saving.load_model(path, safe_mode=True)
        _assert_refused(_our_error(raised.value), expected, names)

    assert not _failures({label: lambda l=label: check(l)
                          for label in _CRAFTED_FILES})


_CANARY = '''
import pathlib
pathlib.Path({marker!r}).write_text("imported")


class Canary:
    def __init__(self, *args, **kwargs):
        pathlib.Path({marker!r}).write_text("run")
'''


@pytest.mark.parametrize("where", ["loss_scale", "inner_optimizer"])
def test_crafted_keras_file_naming_a_module_imports_and_runs_nothing(
        saved_model_file, tmp_path, monkeypatch, where):
    # A module that would announce being imported or run, on the path.
    marker = tmp_path / "canary_was_here"
    (tmp_path / "hostile_canary.py").write_text(
        _CANARY.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))

    def edit(config):
        config[where].update(module="hostile_canary", class_name="Canary",
                             registered_name="hostile_canary>Canary")

    path = _crafted(saved_model_file, tmp_path / "canary.keras", edit)
    with pytest.raises((TypeError, ValueError)) as raised:
        keras.saving.load_model(path, safe_mode=True)
    assert "hostile_canary" not in sys.modules
    assert not marker.exists()
    if where == "loss_scale":
        _assert_refused(_our_error(raised.value), ValueError, ["class_name"])


# ---------------------------------------------------------------------------
# 4. Call-time arguments.


class _Wrapper:
    """A wrapper with two variables (a (3, 2) kernel and a (2,) bias) after
    one applied step, so its slots and counters hold values."""

    def __init__(self, kind):
        self.kind = kind
        loss_scale = tf_lossscale.DynamicLossScale(
            initial_loss_scale=4.0, increment_period=1000)
        self.loss_scale = loss_scale
        if kind == "keras3":
            self.kernel = keras.Variable(np.ones((3, 2), np.float32),
                                         name="kernel")
            self.bias = keras.Variable(np.zeros(2, np.float32), name="bias")
            self.optimizer = tf_lossscale.LossScaleOptimizer(
                keras.optimizers.Adam(0.1), loss_scale)
        elif kind == "tf1":
            self.kernel = tf.Variable(np.ones((3, 2), np.float32),
                                      name="kernel")
            self.bias = tf.Variable(np.zeros(2, np.float32), name="bias")
            self.optimizer = MixedPrecisionLossScaleOptimizer(
                tf.compat.v1.train.AdamOptimizer(0.1), loss_scale)
        else:
            self.kernel = tf.Variable(np.ones((3, 2), np.float32),
                                      name="kernel")
            self.bias = tf.Variable(np.zeros(2, np.float32), name="bias")
            inner = (tf_keras.optimizers.legacy.Adam(0.1)
                     if kind == "tf_keras_legacy"
                     else tf_keras.optimizers.Adam(0.1))
            self.optimizer = tf_lossscale.LossScaleOptimizer(inner,
                                                             loss_scale)
        self.optimizer.apply_gradients([(tf.ones((3, 2)), self.kernel),
                                        (tf.ones(2), self.bias)])

    def name(self, variable):
        return getattr(variable, "path", None) or variable.name

    def state(self):
        """Every variable's value: the weights, then the optimizer's (its
        inner optimizer's slots and counters, the scale's, its own)."""
        variables = self.optimizer.variables
        variables = variables() if callable(variables) else variables
        variables = [self.kernel, self.bias] + list(variables)
        if self.kind == "tf1":
            variables += list(self.loss_scale.variables)
        return [np.array(variable.numpy()) for variable in variables]

    def message(self, error):
        """`error`'s type and message, the variables' names taken out."""
        return type(error).__name__, str(error).replace(
            repr(self.name(self.kernel)), "KERNEL").replace(
                repr(self.name(self.bias)), "BIAS")


_KINDS = ["keras3", "tf_keras", "tf_keras_legacy", "tf1"]


@pytest.fixture(scope="module")
def keras3_wrapper():
    return _Wrapper("keras3")


def _run(mode, fn):
    """`fn()` eagerly, or traced into a tf.function (with XLA for "xla")
    and run; autograph off, so errors come as raised (see
    test_autograph_keeps_the_exception_and_its_message)."""

    def step():
        fn()  # Returns nothing: a TF1 step's op is no function output.

    if mode == "eager":
        step()
    else:
        tf.function(step, autograph=False, jit_compile=(mode == "xla"))()


def _pairs(grad_kernel, grad_bias):
    return lambda w: [(grad_kernel, w.kernel), (grad_bias, w.bias)]


_ONES_KERNEL = tf.ones((3, 2))
_ONES_BIAS = tf.ones(2)

# label: (grads_and_vars for a _Wrapper, exception, the names the message
# must hold: "{kernel}" and "{bias}" stand for the variables' names).
_CALL_CASES = {
    "string_gradient": (
        _pairs(tf.constant([["a", "b"]] * 3), _ONES_BIAS), TypeError,
        ["gradient 0", "{kernel}", "string"]),
    "python_string_gradient": (
        _pairs(_ONES_KERNEL, "ab"), TypeError,
        ["gradient 1", "{bias}", "string"]),
    "int_gradient": (_pairs(_ONES_KERNEL, tf.constant([1, 2])), TypeError,
                     ["gradient 1", "{bias}", "int32"]),
    "numpy_int_gradient": (_pairs(_ONES_KERNEL, np.array([1, 2])), TypeError,
                           ["gradient 1", "{bias}", "int64"]),
    "bool_gradient": (_pairs(_ONES_KERNEL, tf.constant([True, False])),
                      TypeError, ["gradient 1", "{bias}", "bool"]),
    "complex_gradient": (
        _pairs(tf.complex(_ONES_KERNEL, _ONES_KERNEL), _ONES_BIAS),
        TypeError, ["gradient 0", "{kernel}", "complex64"]),
    "object_gradient": (_pairs(object(), _ONES_BIAS), TypeError,
                        ["gradient 0", "{kernel}"]),
    "shape_mismatch": (_pairs(tf.ones((2, 3)), _ONES_BIAS), ValueError,
                       ["gradient 0", "{kernel}", "shape"]),
    "million_element_gradient": (_pairs(_ONES_KERNEL, [1.0] * 10**6),
                                 ValueError, ["gradient 1", "{bias}"]),
    "all_none": (_pairs(None, None), ValueError,
                 ["No gradients provided", "{kernel}"]),
    "empty": (lambda w: [], ValueError, ["No variables"]),
    "not_pairs": (lambda w: [_ONES_KERNEL, _ONES_BIAS], TypeError,
                  ["grads_and_vars[0]"]),
    "triples": (lambda w: [(_ONES_KERNEL, w.kernel, 1)], TypeError,
                ["grads_and_vars[0]"]),
    "string_variable": (lambda w: [(_ONES_BIAS, "a string")], TypeError,
                        ["variable 0"]),
    "none_variable": (lambda w: [(_ONES_BIAS, None)], TypeError,
                      ["variable 0"]),
    "int": (lambda w: 3, TypeError, ["grads_and_vars"]),
    "none": (lambda w: None, TypeError, ["grads_and_vars"]),
    "tensor": (lambda w: _ONES_KERNEL, TypeError, ["grads_and_vars"]),
    "dict": (lambda w: {"weights": _ONES_KERNEL}, TypeError,
             ["grads_and_vars"]),
    "million_pairs_of_nothing": (lambda w: [()] * 10**6, TypeError,
                                 ["grads_and_vars[0]"]),
}


@pytest.fixture(scope="module", params=_KINDS)
def wrapper(request):
    return _Wrapper(request.param)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_apply_gradients_refuses_before_anything_changes(wrapper, mode,
                                                         keras3_wrapper):
    # Names aside, every wrapper says what the Keras 3 one says (but for a
    # triple, which the message shows, each its own variable).
    before = wrapper.state()

    def check(label):
        make_pairs, expected, names = _CALL_CASES[label]
        error, created = hostile_values.attempt(lambda: _run(
            mode, lambda: wrapper.optimizer.apply_gradients(
                make_pairs(wrapper))))
        _assert_refused(error, expected, [
            name.format(kernel=repr(wrapper.name(wrapper.kernel)),
                        bias=repr(wrapper.name(wrapper.bias)))
            for name in names])
        assert not created
        after = wrapper.state()
        assert [v.tobytes() for v in after] == [v.tobytes() for v in before]
        if mode == "eager" and label != "triples":
            reference, _ = hostile_values.attempt(
                lambda: keras3_wrapper.optimizer.apply_gradients(
                    make_pairs(keras3_wrapper)))
            assert wrapper.message(error) == keras3_wrapper.message(reference)

    assert not _failures({label: lambda l=label: check(l)
                          for label in _CALL_CASES})


def test_keras_apply_names_the_counts_not_an_internal_argument():
    wrapper = _Wrapper("keras3")
    before = wrapper.state()
    for grads, variables, expected, names in [
            ([_ONES_KERNEL], None, ValueError, ["1 gradients", "2 variables"]),
            ([_ONES_KERNEL, _ONES_BIAS, _ONES_BIAS], None, ValueError,
             ["3 gradients", "2 variables"]),
            ([], None, ValueError, ["0 gradients"]),
            ([_ONES_KERNEL], [wrapper.kernel, wrapper.bias], ValueError,
             ["1 gradients", "2 variables"]),
            (_ONES_KERNEL, None, TypeError, ["grads"])]:
        error, _ = hostile_values.attempt(
            lambda: wrapper.optimizer.apply(grads, variables))  # pylint: disable=cell-var-from-loop
        _assert_refused(error, expected, names)
        assert "keep" not in str(error)
        assert all(old.tobytes() == new.tobytes()
                   for old, new in zip(before, wrapper.state()))


def test_refused_first_step_leaves_keras_optimizer_unbuilt():
    kernel = keras.Variable(np.ones(3, np.float32))
    optimizer = tf_lossscale.LossScaleOptimizer(keras.optimizers.Adam())
    error, created = hostile_values.attempt(lambda: optimizer.apply_gradients(
        [(tf.constant(["a", "b", "c"]), kernel)]))
    _assert_refused(error, TypeError, ["gradient 0", "string"])
    assert not created
    assert not optimizer.built
    optimizer.apply_gradients([(tf.ones(3), kernel)])  # Builds now.
    assert optimizer.built


@pytest.mark.parametrize("kind", _KINDS)
def test_loss_that_is_not_floating_point_is_refused(kind):
    wrapper = _Wrapper(kind)
    for loss, dtype in [(tf.constant(3), "int32"),
                        (tf.constant("three"), "string"),
                        (tf.constant(True), "bool"), (np.int64(3), "int64")]:
        if kind == "tf1":
            scale = lambda: wrapper.optimizer.compute_gradients(  # pylint: disable=g-long-lambda
                lambda: loss, var_list=[wrapper.kernel])  # pylint: disable=cell-var-from-loop
        else:
            scale = lambda: wrapper.optimizer.get_scaled_loss(loss)  # pylint: disable=cell-var-from-loop
        error, _ = hostile_values.attempt(scale)
        _assert_refused(error, TypeError, ["loss", dtype])
        if kind == "keras3":
            error, _ = hostile_values.attempt(
                lambda: wrapper.optimizer.scale_loss(loss))  # pylint: disable=cell-var-from-loop
            _assert_refused(error, TypeError, ["loss", dtype])


@pytest.mark.parametrize("kind", ["keras3", "tf_keras", "tf_keras_legacy"])
def test_get_unscaled_gradients_refuses_non_floating_gradients(kind):
    wrapper = _Wrapper(kind)
    error, _ = hostile_values.attempt(
        lambda: wrapper.optimizer.get_unscaled_gradients(
            [_ONES_KERNEL, None, tf.constant(["a", "b"])]))
    _assert_refused(error, TypeError, ["gradient 2", "string"])


def test_autograph_keeps_the_exception_and_its_message(keras3_wrapper):
    grads_and_vars = _CALL_CASES["string_gradient"][0](keras3_wrapper)
    with pytest.raises(TypeError) as raised:
        tf.function(lambda: keras3_wrapper.optimizer.apply_gradients(
            grads_and_vars))()
    # Autograph puts the traceback first; the message is the last line.
    last_line = str(raised.value).strip().splitlines()[-1].strip()
    _assert_refused(raised.value, TypeError,
                    ["gradient 0", "'kernel'", "string"], message=last_line)


def _op_types(wrapper):
    pairs = [(_ONES_KERNEL, wrapper.kernel), (_ONES_BIAS, wrapper.bias)]

    def step():
        wrapper.optimizer.apply_gradients(pairs)

    graph = tf.function(step, autograph=False).get_concrete_function().graph
    return sorted(op.type for op in graph.get_operations())


def test_the_checks_add_no_op_to_the_step(wrapper, monkeypatch):
    checked = _op_types(wrapper)
    monkeypatch.setattr(checks, "gradients",
                        lambda grads, variables=None: list(grads))
    assert _op_types(wrapper) == checked


# ---------------------------------------------------------------------------
# 5. Threads.


def _updates_in_threads(loss_scale, grads, threads, updates):
    start = threading.Barrier(threads)
    failures = []

    def work():
        try:
            start.wait()
            for _ in range(updates):
                loss_scale.update(grads)
        except Exception as error:  # pylint: disable=broad-except
            failures.append(error)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=_TIMEOUT_SECONDS)
    assert not failures, failures
    assert not any(worker.is_alive() for worker in workers)


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "nonfinite"])
def test_threads_updating_one_loss_scale_lose_no_update(finite):
    threads, updates = 8, 25

    def make():
        # Grows every 7 finite steps; non-finite steps count consecutive
        # skips and spend the hysteresis budget on the way to the floor.
        return tf_lossscale.DynamicLossScale(
            initial_loss_scale=2.0**20, increment_period=7, hysteresis=3,
            max_consecutive_skips=10**6)

    grads = [tf.constant([1.0, 2.0 if finite else float("nan")])]
    shared, sequential = make(), make()
    _updates_in_threads(shared, grads, threads, updates)
    for _ in range(threads * updates):
        sequential.update(grads)
    assert [v.numpy().tobytes() for v in shared.variables] == [
        v.numpy().tobytes() for v in sequential.variables]
    if finite:
        assert int(shared.good_steps) == threads * updates % 7
    else:
        skips = dict(zip([v.name.split(":")[0] for v in shared.variables],
                         shared.variables))["consecutive_skips"]
        assert int(skips) == threads * updates


def test_graphs_are_not_serialised_by_the_lock():
    loss_scale = tf_lossscale.DynamicLossScale(increment_period=1000)
    @tf.function
    def step():
        loss_scale.update([tf.constant([1.0])])

    done = threading.Event()
    lock = loss_scale._eager_lock  # pylint: disable=protected-access
    lock.__enter__()  # As an eager update in another thread would.
    try:
        worker = threading.Thread(target=lambda: (step(), done.set()))
        worker.start()
        # Tracing and running the graph never wait for the lock.
        assert done.wait(timeout=120)
        worker.join()
    finally:
        lock.__exit__(None, None, None)
    assert int(loss_scale.good_steps) == 1


def test_a_copy_has_its_own_lock_and_state():
    loss_scale = tf_lossscale.DynamicLossScale(increment_period=1000)
    twin = copy.deepcopy(loss_scale)
    assert twin._eager_lock is not loss_scale._eager_lock  # pylint: disable=protected-access
    twin.update([tf.constant([1.0])])
    assert int(twin.good_steps) == 1
    assert int(loss_scale.good_steps) == 0


# ---------------------------------------------------------------------------
# The cost benchmark runs (no timing is asserted here).


def test_hostile_input_costs_benchmark_runs():
    sys.path.insert(0, os.path.join(_PACKAGE_ROOT, "benchmarks"))
    try:
        # pylint: disable=g-import-not-at-top
        from lsbench import context as context_module
        from lsbench import report as report_module
        from lsbench.sections import argument_checks
    finally:
        sys.path.pop(0)
    out = io.StringIO()
    shares = argument_checks.run(context_module.Context(
        report_module.Report(out), context_module.Settings(quick=True)))
    assert set(shares) == {"eager lock", "step checks"}
    assert all(share > 0 for share in shares.values())
    printed = out.getvalue()
    assert "the lock alone" in printed and "the checks alone" in printed

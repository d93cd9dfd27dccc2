"""The tf-keras half of the argument cases of `test_hostile_inputs.py`.

Not a test: the test calls `results()` once in the session's tf-keras
process (conftest's `tf_keras_interpreter`: `TF_USE_LEGACY_KERAS=1`, so
`tf.keras` is tf-keras and `tf_lossscale.LossScaleOptimizer` wraps tf-keras
optimizers, both kinds), which answers `{kind: {case_id: result}}` for the
kinds "optimizer" and "legacy" (`hostile_values.OPTIMIZER` and
`ALREADY_WRAPPED`) and "monitor" (`hostile_values.MONITOR`). A result is
`{"error": the names of the exception's classes (its MRO) or None,
"message": its first 2000 characters, "length": its length, "summary": the
value's summary, "created": names of variables created, "inner_reusable":
whether the inner optimizer can still be wrapped}`; the test judges them.
"""

import tensorflow as tf

from tests.helpers import hostile_values
import tf_lossscale
from tf_lossscale._internal import checks

keras = tf.keras
KINDS = {
    "optimizer": lambda: keras.optimizers.SGD(0.1),
    "legacy": lambda: keras.optimizers.legacy.SGD(0.1),
}


def _result(error, created, value, inner_reusable=True):
    message = "" if error is None else str(error)
    # Every class the exception is an instance of: a test expecting a
    # ValueError accepts one that is also a TypeError.
    return {"error": None if error is None else [
        klass.__name__ for klass in type(error).__mro__],
            "message": message[:2000], "length": len(message),
            "summary": checks.summary(value),
            "created": [str(name) for name in created],
            "inner_reusable": inner_reusable}


def optimizer_case(kind, case):
    inner = KINDS[kind]()
    value = case.make(keras)
    if case.argument == "inner_optimizer":
        error, created = hostile_values.attempt(
            lambda: tf_lossscale.LossScaleOptimizer(value))
    else:
        error, created = hostile_values.attempt(
            lambda: tf_lossscale.LossScaleOptimizer(
                inner, **{case.argument: value}))
    # A refused wrapper must not keep the inner optimizer.
    reusable, _ = hostile_values.attempt(
        lambda: tf_lossscale.LossScaleOptimizer(inner))
    return _result(error, created, value, reusable is None)


def monitor_case(case):
    value = case.make(keras)
    error, created = hostile_values.attempt(
        lambda: tf_lossscale.LossScaleMonitor(**{case.argument: value}))
    return _result(error, created, value)


def results():
    assert keras.__name__.startswith("tf_keras"), keras.__name__
    answers = {kind: {hostile_values.case_id(case): optimizer_case(kind, case)
                      for case in hostile_values.OPTIMIZER + [
                          hostile_values.ALREADY_WRAPPED]}
               for kind in KINDS}
    answers["monitor"] = {hostile_values.case_id(case): monitor_case(case)
                          for case in hostile_values.MONITOR}
    return answers

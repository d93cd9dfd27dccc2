"""A Python process that runs many pieces of test code, one request a line.

Not a test: `subprocesses.Interpreter` starts it (e.g. with
`TF_USE_LEGACY_KERAS=1`, so that `tf.keras` is tf-keras) and keeps it for the
session, so that the tests it serves pay TensorFlow's import once. Each line
on stdin is one JSON request, each answered by one JSON line:

    {"call": "module:function", "args": [...]}  ->  {"result": <its value>}
    {"exec": "<code>", "name": "<file>"}        ->  {"printed": [lines]}

or `{"error": "<traceback>"}`. Answers go to the descriptor that was stdout;
whatever the code prints or TensorFlow logs goes to stderr, except what an
`exec` prints, which is its answer. Like the pytest process, this one splits
its CPU into 4 logical devices before TensorFlow initialises them, and gives
back the global dtype policy a request changed.
"""

import contextlib
import importlib
import io
import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=g-import-not-at-top

NUM_LOGICAL_CPUS = 4


def _call(request):
    module, function = request["call"].split(":")
    return {"result": getattr(importlib.import_module(module), function)(
        *request.get("args", ()))}


def _exec(request):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(request["exec"], request.get("name", "<exec>"), "exec"),  # pylint: disable=exec-used
             {"__name__": "__main__"})
    return {"printed": printed.getvalue().splitlines()}


def _answer(request):
    policy = tf.keras.mixed_precision.global_policy()
    try:
        return _call(request) if "call" in request else _exec(request)
    except Exception:  # pylint: disable=broad-except
        return {"error": traceback.format_exc()}
    finally:
        tf.keras.mixed_precision.set_global_policy(policy)


def main():
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    # Everything else written to stdout, by Python or by TensorFlow's C++,
    # lands in stderr instead of between the answers.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS)
    for line in sys.stdin:
        answers.write(json.dumps(_answer(json.loads(line))) + "\n")
        answers.flush()
    # Stdin closed: the session is over. Threads that TensorFlow or a request
    # left running would hold a normal exit (seen: 30 s and more).
    sys.stderr.flush()
    _save_coverage()
    os._exit(0)  # pylint: disable=protected-access


def _save_coverage():
    # os._exit skips atexit, where coverage (if it measures us) would save.
    coverage = sys.modules.get("coverage")
    current = coverage and coverage.Coverage.current()
    if current is not None:
        current.stop()
        current.save()


if __name__ == "__main__":
    main()

"""Running Python in processes of their own and reading what they answer.

Tests that need another process (tf-keras as `tf.keras`, TF1 behaviour, a
process-wide switch) run a script of `tests/scripts/` or a `-c` program in
one: the package and this repository first on `PYTHONPATH`, TensorFlow's
log quiet, the value printed as JSON on the last line of stdout returned.
Tests that only need `tf.keras` to be tf-keras share one `Interpreter`
(conftest's `tf_keras_interpreter`): a process kept for the session that
runs many requests, each reported to its own test.
"""

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

import tf_lossscale

from tests import helpers

# Bounds a hung process, not a speed requirement.
TIMEOUT_SECONDS = 600
_STDERR_TAIL_CHARS = 6000


def environment(**extra_env):
    """os.environ with `extra_env`, TensorFlow's log quiet, and the package
    under test and this repository first on `PYTHONPATH`."""
    package_root = os.path.dirname(os.path.dirname(tf_lossscale.__file__))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, str(helpers.ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_json(args, timeout=TIMEOUT_SECONDS, **extra_env):
    """Runs `python *args` from tests/scripts/ with `extra_env` added to the
    environment; returns the JSON value of its last stdout line.

    Fails the test with the end of the process' stderr if it exits non-zero.
    """
    done = subprocess.run([sys.executable] + list(args),
                          env=environment(**extra_env), cwd=helpers.SCRIPTS,
                          capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert done.returncode == 0, done.stderr[-_STDERR_TAIL_CHARS:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_script(name, timeout=TIMEOUT_SECONDS, **extra_env):
    """`run_json` of the script `tests/scripts/<name>`."""
    return run_json([str(helpers.SCRIPTS / name)], timeout=timeout, **extra_env)


class Interpreter:
    """A process running `tests/scripts/interpreter.py` with `extra_env`,
    started on the first request and again after it died.

    `call` and `run` fail the test with the request's traceback if it
    raised, or with the end of the process' stderr if the process died or
    did not answer within `timeout` seconds (then it is killed).
    """

    def __init__(self, **extra_env):
        self._env = environment(**extra_env)
        self._process = None

    def call(self, function, *args, timeout=TIMEOUT_SECONDS):
        """The JSON value `function(*args)` returns there; `function` is
        "module:name", e.g. "tests.scripts.tf_keras_journeys:run"."""
        return self._ask({"call": function, "args": args}, timeout)["result"]

    def run(self, code, name="<run>", timeout=TIMEOUT_SECONDS):
        """Executes `code` as a script there; returns the lines it
        printed."""
        return self._ask({"exec": code, "name": name}, timeout)["printed"]

    def close(self):
        if self._process is not None:
            try:
                self._process.stdin.close()
            except OSError:  # It died with a request unread.
                pass
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._stderr.close()
            self._process = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _start(self):
        self._stderr = tempfile.TemporaryFile("w+")
        self._process = subprocess.Popen(
            [sys.executable, str(helpers.SCRIPTS / "interpreter.py")], env=self._env,
            cwd=helpers.SCRIPTS, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True)
        self._answers = queue.Queue()
        threading.Thread(target=self._read_answers, args=(self._process,),
                         daemon=True).start()

    def _read_answers(self, process):
        for line in process.stdout:
            self._answers.put(line)
        self._answers.put(None)  # The process closed its stdout: it ended.

    def _ask(self, request, timeout):
        if self._process is None or self._process.poll() is not None:
            self.close()
            self._start()
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            line = None
            self._process.kill()
        if line is None:
            self._process.wait()
            self._stderr.seek(0)
            tail = self._stderr.read()[-_STDERR_TAIL_CHARS:]
            self.close()
            raise AssertionError(f"the interpreter ended or did not answer "
                                 f"within {timeout} s:\n{tail}")
        answer = json.loads(line)
        assert "error" not in answer, answer.get("error")
        return answer

"""Running Python in a process of its own and reading the JSON it prints.

Tests that need a fresh process (tf-keras as `tf.keras`, TF1 behaviour, a
process-wide switch) run a script of `tests/support/` or a `-c` program in
one: the package and this repository first on `PYTHONPATH`, TensorFlow's
log quiet, the value printed as JSON on the last line of stdout returned.
"""

import json
import os
import subprocess
import sys

import tf_lossscale

from tests.support import paths

# Bounds a hung process, not a speed requirement.
TIMEOUT_SECONDS = 600


def run_json(args, timeout=TIMEOUT_SECONDS, **extra_env):
    """Runs `python *args` from tests/support/ with `extra_env` added to the
    environment; returns the JSON value of its last stdout line.

    Fails the test with the end of the process' stderr if it exits non-zero.
    """
    package_root = os.path.dirname(os.path.dirname(tf_lossscale.__file__))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, str(paths.ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable] + list(args), env=env,
                          cwd=paths.SUPPORT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_script(name, timeout=TIMEOUT_SECONDS, **extra_env):
    """`run_json` of the script `tests/support/<name>`."""
    return run_json([paths.script(name)], timeout=timeout, **extra_env)

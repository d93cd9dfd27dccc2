"""Runs `python -m tf_lossscale.demo` once per command line, as a user does,
as if neither optional extra (matplotlib, tensorboard) were installed.

Not a test: test_demo.py runs `python demo_command_lines.py '<JSON list of
argument lists>'` and reads the one JSON line it prints last, a list of
`{"returncode", "stdout", "stderr"}`, one per command line.

Each command runs in a process of its own, forked from this one after the
imports, so that all of them pay TensorFlow's import once. A child runs the
demo's `__main__` with `runpy`, as `python -m` does, and leaves through the
interpreter's own exit: its status, and the message of a `sys.exit("...")`
on stderr, are what a user sees. This process never initialises
TensorFlow's devices, so each child splits its CPU as its flags say.

Forking is for Linux only: macOS' system libraries are not safe to use in a
forked child (Python's multiprocessing spawns there) and Windows has no
fork. Elsewhere each command runs in a new interpreter.
"""

import gc
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile

# Importing an extra fails, as when it is not installed.
sys.modules["matplotlib"] = None
sys.modules["tensorboard"] = None

_FORK = sys.platform.startswith("linux")


def _run_demo(argv):
    """This process becomes `python -m tf_lossscale.demo *argv`."""
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("tf_lossscale.demo", run_name="__main__", alter_sys=True)


def _redirect(fd, path):
    file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(file, fd)
    os.close(file)


def main(command_lines):
    if _FORK:
        # What the demo's `__main__` imports; not `__main__` itself, which
        # runpy runs afresh in each child.
        import absl.app  # pylint: disable=g-import-not-at-top,unused-import,import-outside-toplevel
        import tf_lossscale.demo  # pylint: disable=g-import-not-at-top,unused-import,import-outside-toplevel
        # A child's garbage collections, at its exit too, would otherwise
        # visit, and so copy, every object of these imports (a second each).
        gc.freeze()
    outputs = tempfile.mkdtemp()
    results = []
    for index, argv in enumerate(command_lines):
        out = os.path.join(outputs, f"{index}.out")
        err = os.path.join(outputs, f"{index}.err")
        if _FORK:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _redirect(1, out)
                _redirect(2, err)
                # No `finally` or `with` around: however the demo ends
                # (SystemExit, an exception, a return), so does the child.
                _run_demo(argv)
                return
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        else:
            with open(out, "w") as stdout, open(err, "w") as stderr:
                code = subprocess.run(
                    [sys.executable, __file__, "--one", json.dumps(argv)],
                    stdout=stdout, stderr=stderr, check=False).returncode
        with open(out) as stdout, open(err) as stderr:
            results.append({"returncode": code, "stdout": stdout.read(),
                            "stderr": stderr.read()})
    shutil.rmtree(outputs)
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        _run_demo(json.loads(sys.argv[2]))
    else:
        main(json.loads(sys.argv[1]))

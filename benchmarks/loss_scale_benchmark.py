"""Side-by-side cost of loss scaling, printed as ratios measured in one run.

Run (one command; about 15 minutes on a quiet 2-core machine, 37 at load 8):

    python benchmarks/loss_scale_benchmark.py [--quick] [--only=NAME,...]
        [--rounds=N] [--fit_steps=N] [--fit_rounds=N]

Machines here are noisy and shared, so absolute times mean little: every
comparison runs its candidates in interleaved rounds within this one process
(`lsbench.timing`, `lsbench.fit_runs`), takes medians of per-round ratios,
and prints them with each target and whether it holds. The run starts with
the machine (CPU model, cores, TensorFlow, Keras) and its load, and ends with
the load again, every verdict, and every table in Markdown: what
docs/guides/performance.md shows.

Sections (`lsbench/sections/`, run in this order; `--only` picks some):

  check     check + unscale + update on three gradient sets (TF 2.x protocol)
  apply     the Keras-protocol apply path, against Keras 3's wrapper
  ops       ops per tensor of the traced step, ours and Keras 3's (exact)
  collectives
            collectives per traced training step (exact; in a child process
            with 2 logical CPUs) under MultiWorkerMirroredStrategy and
            MirroredStrategy: ours, Keras 3's and no loss scaling, with one
            optimizer, two, and per layer
  hotpath   each technique of the check and the unscale against the plain
            form, on the three gradient sets, in graph mode and under XLA
  fit       `model.fit` without XLA: overhead, the barrier, the monitor, and
            the cost of each feature (the step with one feature taken away:
            `lsbench/ablations.py`)
  xla       `model.fit` under XLA, and the XLA record's cost
  replicas  `model.fit` under MirroredStrategy over 2 logical CPUs (in a
            child process)
  workers   a custom training loop under MultiWorkerMirroredStrategy in two
            worker processes on 127.0.0.1, each worker's CPU time
  stats     the opt-in gradient statistics (`LossScaleMonitor(
            gradient_stats=True)`): alone against the finiteness check, and
            in `model.fit` with and without XLA
  checks    the argument checks and the eager lock (eager work only: no op
            in a traced step)
  diagnosis `tf_lossscale.diagnose` and `fix` on a ResNet-50, in seconds
            and in training steps' worth
  layerwise per-layer gradient scaling: its demonstration model (loss
            curves and underflow shares in float32, with one loss scale and
            per layer), and its cost per step against one loss scale (ops,
            XLA instructions, fit's CPU time)
  watch     `FailureWatch` in a healthy `model.fit`, with and without XLA,
            and the XLA kernels per step with it and without

`--quick` uses small gradient sets, a 1x16 MLP and one round: it checks that
everything runs (tests/tools/test_benchmark_quick.py); its figures mean
nothing.

Adding a section (for instance the cost of an opt-in monitor feature): write
a module `lsbench/sections/<name>.py` with

    NAME = "<name>"          # for --only
    TITLE = "..."            # printed, and the title of its tables
    def run(context): ...    # context.report, context.settings

and add it to `SECTIONS` below. A section times its candidates with
`lsbench.timing.interleaved` (step-level) or `lsbench.fit_runs` (`fit`:
`Candidate`, `build`, `interleaved_fits`), prints through `context.report`
(`line`; `target(description, value, limit)` for each target, which the
summary counts; `table(title, columns)` then `show(table)` for its figures,
which the summary prints again in Markdown), and adds a row to the cost per
feature with `report.shared_table(fit_step.FEATURES_TITLE,
fit_step.FEATURES_COLUMNS)` when it measures one. Keep the candidates of one
comparison in one interleaved call, so that load hits them alike.
"""

import os
import platform
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The package of this checkout, not another installed one (an editable
# install of a different worktree would otherwise be measured).
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import tf_lossscale  # pylint: disable=g-import-not-at-top,wrong-import-position

from lsbench import context as context_module  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench import report as report_module  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import argument_checks  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import apply_path  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import check_unscale_update  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import collectives  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import diagnosis  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import failure_watch  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import fit_step  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import gradient_stats  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import hot_path  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import per_layer  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import replicas  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import step_ops  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import two_workers  # pylint: disable=g-import-not-at-top,wrong-import-position
from lsbench.sections import xla_fit  # pylint: disable=g-import-not-at-top,wrong-import-position

tf.get_logger().setLevel("ERROR")  # TF's reference is deprecated; it says so.

# `collectives` right after `ops`: its counts beside the XLA kernel counts.
SECTIONS = (check_unscale_update, apply_path, step_ops, collectives, hot_path,
            fit_step, xla_fit, replicas, two_workers, gradient_stats,
            argument_checks, per_layer, failure_watch, diagnosis)


def _cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True,
                             check=False).stdout
    except OSError:
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _load():
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return ", ".join(f"{value:.2f}" for value in os.getloadavg())


def run(quick=False, rounds=None, fit_steps=None, fit_rounds=None,
        only=None, out=None):
    """Runs the sections (all, or those named in `only`); returns the
    `lsbench.report.Report`: its verdicts, [(target, holds)], its tables,
    and what each section's `run` returned, by section name."""
    report = report_module.Report(out)
    settings = context_module.Settings(quick, rounds, fit_steps, fit_rounds)
    sections = [s for s in SECTIONS if only is None or s.NAME in only]
    unknown = set(only or ()) - {s.NAME for s in SECTIONS}
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; the sections "
                         f"are {[s.NAME for s in SECTIONS]}")
    keras.mixed_precision.set_global_policy("mixed_float16")
    report.line(f"Machine: {_cpu_model()}, {os.cpu_count()} CPUs; "
                f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
                f"Python {platform.python_version()}")
    report.line(f"tf_lossscale from {os.path.dirname(tf_lossscale.__file__)}")
    report.line(f"Load average (1, 5, 15 min) at the start: {_load()}")
    report.line(f"Step-level sections: median of {settings.step_rounds} "
                f"interleaved rounds of {settings.calls} calls"
                f"{' (quick: figures mean nothing)' if quick else ''}")
    context = context_module.Context(report, settings)
    for section in sections:
        report.results[section.NAME] = section.run(context)
    report.line(f"\nLoad average (1, 5, 15 min) at the end: {_load()}")
    report.summary()
    return report


def main(argv):
    options = {}
    for arg in argv:
        name, _, value = arg.partition("=")
        if arg == "--quick":
            options["quick"] = True
        elif name in ("--rounds", "--fit_steps", "--fit_rounds") and value:
            options[name[2:]] = int(value)
        elif name == "--only" and value:
            options["only"] = value.split(",")
        else:
            raise SystemExit(f"unknown argument {arg!r}; use --quick, "
                             "--only=NAME,..., --rounds=N, --fit_steps=N, "
                             "--fit_rounds=N")
    run(**options)


if __name__ == "__main__":
    main(sys.argv[1:])

"""`model.fit` under MirroredStrategy on two logical CPUs, against Keras 3's.

The same MLP as the other `fit` sections trains under a MirroredStrategy of
two replicas (two logical devices of this machine's CPU, reducing through
one device), without XLA: no loss scaling, Keras 3's wrapper (which lets
replica 0 decide alone: a NaN only on replica 1 is applied) and
tf_lossscale, whose agreement is the gradients' own all-reduce moved ahead
of the decision (every replica decides from the same sums: no op of its
own, `sections.collectives` counts it).

Logical devices must be set up before TensorFlow starts, so this section
runs in a child process of its own.

Target: tf_lossscale's CPU overhead over no loss scaling at most Keras 3's.
"""

import json
import pathlib
import subprocess
import sys

NAME = "replicas"
TITLE = ("model.fit under MirroredStrategy (2 logical CPUs), CPU time over "
         "no loss scaling")

_KERAS = "Keras 3 LossScaleOptimizer"
_OURS = "tf_lossscale"


def run(context):
    """Returns the `fit_runs.Ratios`."""
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top
    from lsbench import report as report_module  # pylint: disable=g-import-not-at-top

    report, settings = context.report, context.settings
    shape = fit_runs.fit_shape(settings)
    report.line(f"\n{NAME}: {TITLE}: the same {shape.depth}x{shape.width} "
                f"MLP, batch {shape.batch_size} ({shape.batch_size // 2} per "
                f"replica), {shape.steps} steps per run, {shape.rounds} rounds "
                "(in a child process)")
    child = subprocess.run(
        [sys.executable, __file__, json.dumps(settings._asdict())],
        capture_output=True, text=True, check=False,
        cwd=pathlib.Path(__file__).resolve().parents[2])
    if child.returncode != 0:
        raise RuntimeError(f"the {NAME} section's child process failed:\n"
                           f"{child.stderr[-4000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    ratios = fit_runs.Ratios(result["cpu"], result["wall"])
    fit_runs.show(report, ratios)
    holds = report.target(
        "MirroredStrategy fit: tf_lossscale's CPU overhead at most Keras 3's",
        ratios.overhead(_OURS), ratios.overhead(_KERAS))
    table = report.table(TITLE, ["run", "CPU time", "wall time", "target"])
    for name in ratios.cpu:
        target = (f"≤ Keras 3's ({fit_runs.percent(ratios.overhead(_KERAS))})"
                  f" {report_module.verdict(holds)}" if name == _OURS else "")
        table.add(name, fit_runs.percent(ratios.overhead(name)),
                  fit_runs.percent(ratios.wall[name] - 1.0), target)
    report.show(table)
    return ratios


def _child(settings_json):
    """Runs in the child: two logical CPUs, then the fits; prints JSON."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras  # pylint: disable=g-import-not-at-top
    import tf_lossscale  # pylint: disable=g-import-not-at-top
    from lsbench import context  # pylint: disable=g-import-not-at-top
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top

    settings = context.Settings(**json.loads(settings_json))
    shape = fit_runs.fit_shape(settings)
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"],
        cross_device_ops=tf.distribute.ReductionToOneDevice())
    candidates = {
        fit_runs.BASELINE: fit_runs.Candidate(),
        _KERAS: fit_runs.Candidate(keras.optimizers.LossScaleOptimizer),
        _OURS: fit_runs.Candidate(tf_lossscale.LossScaleOptimizer),
    }
    ratios = fit_runs.interleaved_fits(
        fit_runs.build(candidates, shape, strategy=strategy), shape,
        shape.rounds)
    print(json.dumps({"cpu": ratios.cpu, "wall": ratios.wall}))


if __name__ == "__main__":
    # lsbench, and the package of this checkout (as the runner imports it).
    sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[i])
                    for i in (2, 3)]
    _child(sys.argv[1])

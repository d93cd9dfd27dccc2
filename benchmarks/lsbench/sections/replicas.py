"""`model.fit` under MirroredStrategy over two logical CPUs: the agreement.

Without a strategy the replica agreement holds no op. Here the same MLP
trains under a MirroredStrategy of two replicas (two logical devices of
this machine's CPU, reducing through one device), without XLA: no loss
scaling, Keras 3's wrapper (which lets replica 0 decide alone: a NaN only on
replica 1 is applied), tf_lossscale, and tf_lossscale with replica 0
deciding alone as well (`lsbench.ablations`), whose difference is what the
agreement's one all-reduce of one scalar costs.

Logical devices must be set up before TensorFlow starts, so this section
runs in a child process of its own; no target.
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
_FEATURE = "the replica agreement"
_WITHOUT = f"tf_lossscale without {_FEATURE}"


def run(context):
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top
    from lsbench.sections import fit_step  # pylint: disable=g-import-not-at-top

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
    table = report.table(TITLE, ["run", "CPU time", "wall time"])
    for name in ratios.cpu:
        table.add(name, fit_runs.percent(ratios.overhead(name)),
                  fit_runs.percent(ratios.wall[name] - 1.0))
    report.show(table)
    features = report.shared_table(fit_step.FEATURES_TITLE,
                                   fit_step.FEATURES_COLUMNS)
    features.add(_FEATURE, "2 replicas, no XLA", result["ops"],
                 result["removed"], "-", fit_runs.percent(
                     ratios.cpu[_OURS] - ratios.cpu[_WITHOUT]))


def _child(settings_json):
    """Runs in the child: two logical CPUs, then the fits; prints JSON."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras  # pylint: disable=g-import-not-at-top
    from lsbench import ablations  # pylint: disable=g-import-not-at-top
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
        _OURS: fit_runs.Candidate(ablations.full),
        _WITHOUT: fit_runs.Candidate(ablations.by_feature(_FEATURE).make),
    }
    ratios = fit_runs.interleaved_fits(
        fit_runs.build(candidates, shape, strategy=strategy), shape,
        shape.rounds)
    shapes = [tuple(v.shape) for v in fit_runs.mlp(shape).trainable_variables]
    total, removed = ablations.ops_removed(ablations.by_feature(_FEATURE),
                                           shapes, strategy=strategy)
    print(json.dumps({"cpu": ratios.cpu, "wall": ratios.wall, "ops": total,
                      "removed": removed}))


if __name__ == "__main__":
    # lsbench, and the package of this checkout (as the runner imports it).
    sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[i])
                    for i in (2, 3)]
    _child(sys.argv[1])

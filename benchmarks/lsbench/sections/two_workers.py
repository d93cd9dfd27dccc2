"""A custom training loop in two worker processes, against Keras 3's wrapper.

Keras 3.15's `model.fit` fails under MultiWorkerMirroredStrategy even in
float32 without loss scaling (a `ValueError` converting a `PerReplica`
value), so the step here is a custom one: `strategy.run` of a `tf.function`
step over the `fit` MLP (mixed_bfloat16, for `fit_runs`' reason), global
batch as `fit`'s, in two worker processes on 127.0.0.1 (`TF_CONFIG` with two
free ports), one replica each, every reduction a collective between the two
processes. Candidates: no loss scaling, Keras 3's wrapper and tf_lossscale,
SGD inside, each with its own model, run `steps` steps in turn in each round
within the same two processes (interleaved, so that load hits them alike;
each run ends with a read of a weight, so that its time holds its work).
Each worker measures its own process CPU time (all threads) and wall time
per run; the medians of per-round ratios to no loss scaling are printed per
worker.

Target: tf_lossscale's CPU overhead at most Keras 3's, in the mean of the
two workers' medians.

Time: two rounds took 62 s of wall time at load 8 on this project's 2-core
machines, the workers' start (TensorFlow's import, the cluster's set-up)
included; each further round adds three runs of `steps` steps.
"""

import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

NAME = "workers"
TITLE = ("Custom training loop under MultiWorkerMirroredStrategy (2 worker "
         "processes on 127.0.0.1), CPU time over no loss scaling")

BASELINE = "no loss scaling"
_KERAS = "Keras 3 LossScaleOptimizer"
_OURS = "tf_lossscale"
CANDIDATES = (BASELINE, _KERAS, _OURS)
NUM_WORKERS = 2
# A bound for a hung job (a worker waiting in a collective for a peer that
# died), not a speed requirement.
_TIMEOUT_SECONDS = 900


def run(context):
    """Returns each worker's {"cpu": {name: ratio}, "wall": {...}}."""
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top
    from lsbench import report as report_module  # pylint: disable=g-import-not-at-top

    report, settings = context.report, context.settings
    shape = fit_runs.fit_shape(settings)
    report.line(f"\n{NAME}: {TITLE}: the {shape.depth}x{shape.width} MLP, "
                f"global batch {shape.batch_size} "
                f"({shape.batch_size // NUM_WORKERS} per worker), "
                f"{shape.steps} steps per run, {shape.rounds} rounds")
    workers = _run_job(json.dumps(settings._asdict()))
    report.line(f"  {'':<30} " + "  ".join(
        f"{f'worker {w}: CPU (wall)':>22}" for w in range(NUM_WORKERS)))
    for name in CANDIDATES:
        report.line(f"  {name:<30} " + "  ".join(
            f"{'':>8}x{w['cpu'][name]:.3f} (x{w['wall'][name]:.3f})"
            for w in workers))
    overhead = {name: statistics.mean(w["cpu"][name] for w in workers) - 1.0
                for name in CANDIDATES}
    holds = report.target(
        "two workers: tf_lossscale's CPU overhead at most Keras 3's (mean of "
        "the workers)", overhead[_OURS], overhead[_KERAS])
    table = report.table(TITLE, [
        "run", *[f"worker {w}: CPU time" for w in range(NUM_WORKERS)],
        "mean", "worker 0: wall time", "target"])
    for name in CANDIDATES:
        target = (f"≤ Keras 3's ({fit_runs.percent(overhead[_KERAS])}) "
                  f"{report_module.verdict(holds)}" if name == _OURS else "")
        table.add(name, *[fit_runs.percent(w["cpu"][name] - 1.0)
                          for w in workers],
                  fit_runs.percent(overhead[name]),
                  fit_runs.percent(workers[0]["wall"][name] - 1.0), target)
    report.show(table)
    return workers


def _free_ports(count):
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_job(settings_json):
    """Starts the workers, waits for both (or the first failure); returns
    each worker's JSON result, in task order."""
    cluster = {"worker": [f"127.0.0.1:{port}"
                          for port in _free_ports(NUM_WORKERS)]}
    with tempfile.TemporaryDirectory() as folder:
        outputs = [os.path.join(folder, f"worker{t}.out")
                   for t in range(NUM_WORKERS)]
        errors = [os.path.join(folder, f"worker{t}.err")
                  for t in range(NUM_WORKERS)]
        processes = []
        try:
            for task_id in range(NUM_WORKERS):
                env = dict(os.environ, TF_CONFIG=json.dumps({
                    "cluster": cluster,
                    "task": {"type": "worker", "index": task_id}}))
                with open(outputs[task_id], "w") as out, \
                        open(errors[task_id], "w") as err:
                    processes.append(subprocess.Popen(
                        [sys.executable, __file__, settings_json], env=env,
                        cwd=pathlib.Path(__file__).resolve().parents[2],
                        stdout=out, stderr=err))
            deadline = time.monotonic() + _TIMEOUT_SECONDS
            # A worker that dies leaves its peer waiting in a collective:
            # stop at the first failure instead of waiting for the deadline.
            while (any(p.poll() is None for p in processes)
                   and not any(p.poll() for p in processes)
                   and time.monotonic() < deadline):
                time.sleep(0.2)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait()
        if any(p.returncode != 0 for p in processes):
            tails = "\n".join(
                f"--- worker {t} stderr (tail) ---\n"
                f"{pathlib.Path(path).read_text(errors='replace')[-3000:]}"
                for t, path in enumerate(errors))
            raise RuntimeError(
                f"the {NAME} section's workers failed (exit codes "
                f"{[p.returncode for p in processes]}; negative: killed "
                f"after {_TIMEOUT_SECONDS} s or after the other's "
                f"failure):\n{tails}")
        return [json.loads(pathlib.Path(path).read_text().strip()
                           .splitlines()[-1]) for path in outputs]


# What follows runs in each worker process.


def _train(strategy, shape, make_optimizer, task_id):
    """A callable that runs `shape.steps` custom steps of a new MLP with
    `make_optimizer(SGD)` (or SGD itself) on this worker's fixed batch, and
    waits for them."""
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top

    with strategy.scope():
        model = fit_runs.mlp(shape)
        inner = keras.optimizers.SGD(0.01)
        optimizer = inner if make_optimizer is None else make_optimizer(inner)
        optimizer.build(model.trainable_variables)
    x, y = fit_runs.data(shape)
    local = shape.batch_size // NUM_WORKERS
    x = tf.constant(x[task_id * local:(task_id + 1) * local])
    y = tf.constant(y[task_id * local:(task_id + 1) * local])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)
    variables = model.trainable_variables

    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_fn(y, model(x, training=True)),
                global_batch_size=shape.batch_size)
            # Keras 3's plain optimizers return the loss as it is.
            scaled = optimizer.scale_loss(loss)
        optimizer.apply(tape.gradient(scaled, variables), variables)

    @tf.function
    def step():
        strategy.run(replica_step)

    def train():
        for _ in range(shape.steps):
            step()
        variables[0].numpy()  # Waits for the last step.

    return train


def _worker(settings_json):
    """One worker: the candidates in interleaved rounds; prints JSON."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    # First, as TensorFlow asks: the strategy sets up the collectives.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    tf.get_logger().setLevel("ERROR")
    import warnings  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    import tf_lossscale  # pylint: disable=g-import-not-at-top
    from lsbench import context  # pylint: disable=g-import-not-at-top
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top

    shape = fit_runs.fit_shape(context.Settings(**json.loads(settings_json)))
    task_id = strategy.cluster_resolver.task_id
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    with warnings.catch_warnings():
        # That bfloat16 needs no scaling: the scaling is what is measured.
        warnings.simplefilter("ignore", UserWarning)
        runs = {
            BASELINE: _train(strategy, shape, None, task_id),
            _KERAS: _train(strategy, shape,
                           keras.optimizers.LossScaleOptimizer, task_id),
            _OURS: _train(strategy, shape, tf_lossscale.LossScaleOptimizer,
                          task_id),
        }
        for train in runs.values():
            train()  # Trace and warm up.
        cpu = {name: [] for name in runs}
        wall = {name: [] for name in runs}
        for _ in range(shape.rounds):
            times = {}
            for name, train in runs.items():
                start_cpu, start_wall = time.process_time(), time.perf_counter()
                train()
                times[name] = (time.process_time() - start_cpu,
                               time.perf_counter() - start_wall)
            base_cpu, base_wall = times[BASELINE]
            for name, (cpu_time, wall_time) in times.items():
                cpu[name].append(cpu_time / base_cpu)
                wall[name].append(wall_time / base_wall)
    print(json.dumps({
        "task": task_id,
        "cpu": {n: statistics.median(v) for n, v in cpu.items()},
        "wall": {n: statistics.median(v) for n, v in wall.items()}}),
          flush=True)


if __name__ == "__main__":
    # lsbench, and the package of this checkout (as the runner imports it).
    sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[i])
                    for i in (2, 3)]
    _worker(sys.argv[1])

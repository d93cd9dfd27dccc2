"""Collectives per traced training step: ours, Keras 3's, the plain form.

On many GPUs each collective is a launch and a synchronisation of every
device, and across machines a network round trip, whatever its size: a
latency no fusion hides, and one that grows with the number of workers. So
the count is what a step pays there beyond its kernels (`ops`: the XLA
kernel counts), and, like them, it is exact, the same on every machine with
the same TensorFlow, and needs no GPU: every op of the traced step's graph
and of every function in its library whose type starts with "Collective" or
"Nccl", both branches of every `tf.cond` included. Steps are traced, never
run, in a child process with two logical CPUs, under

* MultiWorkerMirroredStrategy over the two local devices (one worker, as
  TensorFlow's own tests make it): every reduction is a collective op, as
  between machines;
* MirroredStrategy with its default cross-device ops;
* MirroredStrategy with `NcclAllReduce`, its default on GPUs (traced only:
  the graph is what a GPU would launch; NCCL has no CPU kernel to run).

Rows, each with no loss scaling (the plain form), Keras 3's
`keras.optimizers.LossScaleOptimizer` and tf_lossscale, Adam inside: one
optimizer in a custom step (`strategy.run`) over the `fit` MLP; two
optimizers, one per half of its layers (a `tf_lossscale.LossScaleGroup` of
two, each step alone and in `group.iteration()`, against two plain
optimizers and two Keras 3 wrappers); the MLP compiled and scaled per layer
(`tf_lossscale.layerwise.scale_per_layer`), its `train_step`, against the
same model compiled without loss scaling and with Keras 3's wrapper.

Target: tf_lossscale's count equals the plain form's on every row, under
every strategy (the gradients' own all-reduce, and no collective of its
own).
"""

import collections
import json
import pathlib
import subprocess
import sys

NAME = "collectives"
TITLE = ("Collectives per traced training step (exact): tf_lossscale, "
         "Keras 3's wrapper and no loss scaling")

PLAIN = "no loss scaling"
KERAS = "Keras 3"
OURS = "tf_lossscale"
FORMS = (PLAIN, KERAS, OURS)

STRATEGIES = (
    "MultiWorkerMirrored, 2 local devices",
    "Mirrored, its default cross-device ops",
    "Mirrored, NcclAllReduce (GPUs' default)",
)
ROWS = (
    "one optimizer",
    "two optimizers: a LossScaleGroup",
    "two optimizers: a LossScaleGroup in iteration()",
    "per layer: scale_per_layer, train_step",
)


def run(context):
    """Returns {strategy: {row: {form: collectives}}}."""
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top

    report, settings = context.report, context.settings
    shape = fit_runs.fit_shape(settings)
    report.line(f"\n{NAME}: {TITLE}: the {shape.depth}x{shape.width} MLP of "
                "`fit`, Adam, traced in a child process with two logical "
                "CPUs (exact counts, no timing)")
    child = subprocess.run(
        [sys.executable, __file__, json.dumps(settings._asdict())],
        capture_output=True, text=True, check=False,
        cwd=pathlib.Path(__file__).resolve().parents[2])
    if child.returncode != 0:
        raise RuntimeError(f"the {NAME} section's child process failed:\n"
                           f"{child.stderr[-4000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    counts, types = result["counts"], result["types"]
    table = report.table(TITLE, [
        "strategy", "step", *[f"collectives: {form}" for form in FORMS],
        "op types (tf_lossscale)", f"{OURS} = {PLAIN}"])
    for strategy in STRATEGIES:
        for row in ROWS:
            measured = counts[strategy][row]
            ours, plain = measured[OURS], measured[PLAIN]
            report.line(f"  {strategy}: {row}: " + ", ".join(
                f"{form} {measured[form]}" for form in FORMS))
            holds = report.target(
                f"collectives, {strategy}, {row}: tf_lossscale's count "
                "minus no loss scaling's, in absolute value",
                abs(ours - plain), 0)
            table.add(strategy, row, *[measured[form] for form in FORMS],
                      types[strategy][row] or "-",
                      _verdict(holds))
    report.show(table)
    return counts


def _verdict(holds):
    from lsbench import report as report_module  # pylint: disable=g-import-not-at-top
    return report_module.verdict(holds)


# What follows runs in the child process.


def _collectives(function):
    """A `collections.Counter` of the collective op types of the traced
    `function` (a `tf.function` taking no arguments): its graph and every
    function of its library."""
    graph_def = function.get_concrete_function().graph.as_graph_def()
    nodes = [*graph_def.node, *(node for f in graph_def.library.function
                                for node in f.node_def)]
    return collections.Counter(node.op for node in nodes
                               if node.op.startswith(("Collective", "Nccl")))


def _batch(shape, replicas):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    per_replica = shape.batch_size // replicas
    return (tf.ones([per_replica, shape.width]),
            tf.zeros([per_replica], tf.int64))


def _custom_step(strategy, shape, make_optimizers, block=None):
    """The collectives of one custom step (`strategy.run`) of the `fit` MLP:
    the loss scaled by each optimizer (Keras 3's plain optimizers return it
    as it is), each optimizer applying the gradients of its part of the
    layers (all of them for one optimizer), inside `block()` if given."""
    import contextlib  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top

    with strategy.scope():
        model = fit_runs.mlp(shape)
        optimizers = make_optimizers()
        layers = [layer for layer in model.layers if layer.trainable_variables]
        if len(optimizers) == 1:
            parts = [model.trainable_variables]
        else:
            half = len(layers) // 2
            parts = [[v for layer in layers[:half]
                      for v in layer.trainable_variables],
                     [v for layer in layers[half:]
                      for v in layer.trainable_variables]]
        for optimizer, part in zip(optimizers, parts):
            optimizer.build(part)
    x, y = _batch(shape, strategy.num_replicas_in_sync)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        reduction="sum_over_batch_size")

    def replica_step():
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = [optimizer.scale_loss(loss) for optimizer in optimizers]
        grads = [tape.gradient(s, part) for s, part in zip(scaled, parts)]
        with block() if block else contextlib.nullcontext():
            for optimizer, g, part in zip(optimizers, grads, parts):
                optimizer.apply(g, part)

    @tf.function
    def step():
        strategy.run(replica_step)

    return _collectives(step)


def _one_optimizer(strategy, shape):
    import keras  # pylint: disable=g-import-not-at-top
    import tf_lossscale  # pylint: disable=g-import-not-at-top
    adam = keras.optimizers.Adam
    return {
        PLAIN: _custom_step(strategy, shape, lambda: [adam()]),
        KERAS: _custom_step(strategy, shape, lambda: [
            keras.optimizers.LossScaleOptimizer(adam())]),
        OURS: _custom_step(strategy, shape, lambda: [
            tf_lossscale.LossScaleOptimizer(adam())]),
    }


def _two_optimizers(strategy, shape, in_block):
    import keras  # pylint: disable=g-import-not-at-top
    import tf_lossscale  # pylint: disable=g-import-not-at-top
    adam = keras.optimizers.Adam
    groups = []

    def grouped():
        # Made in the strategy's scope, with the optimizers.
        groups.append(tf_lossscale.LossScaleGroup())
        return [tf_lossscale.LossScaleOptimizer(adam(), loss_scale=groups[-1])
                for _ in range(2)]

    def block():
        return groups[-1].iteration()

    return {
        PLAIN: _custom_step(strategy, shape, lambda: [adam(), adam()]),
        KERAS: _custom_step(strategy, shape, lambda: [
            keras.optimizers.LossScaleOptimizer(adam()) for _ in range(2)]),
        OURS: _custom_step(strategy, shape, grouped,
                           block if in_block else None),
    }


def _per_layer(strategy, shape):
    """The compiled models' `train_step` (what `fit` runs in each replica):
    the MLP without loss scaling, with Keras 3's wrapper, and scaled per
    layer from its compilation with tf_lossscale's."""
    import warnings  # pylint: disable=g-import-not-at-top
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import tf_lossscale  # pylint: disable=g-import-not-at-top
    from tf_lossscale import layerwise  # pylint: disable=g-import-not-at-top
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top

    adam = keras.optimizers.Adam
    runs = fit_runs.build({
        PLAIN: fit_runs.Candidate(inner=adam),
        KERAS: fit_runs.Candidate(keras.optimizers.LossScaleOptimizer,
                                  inner=adam),
        OURS: fit_runs.Candidate(tf_lossscale.LossScaleOptimizer,
                                 inner=adam),
    }, shape, strategy=strategy)
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        with warnings.catch_warnings():
            # That bfloat16 needs no scaling: the scaling is what is counted.
            warnings.simplefilter("ignore", UserWarning)
            scaled = layerwise.scale_per_layer(runs[OURS][0])
    finally:
        keras.mixed_precision.set_global_policy(previous)
    models = {PLAIN: runs[PLAIN][0], KERAS: runs[KERAS][0], OURS: scaled}
    data = _batch(shape, strategy.num_replicas_in_sync)
    counts = {}
    for form, model in models.items():
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)

        @tf.function
        def step(model=model):
            strategy.run(model.train_step, args=(data,))

        counts[form] = _collectives(step)
    return counts


def _strategies():
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    devices = ["/cpu:0", "/cpu:1"]
    return dict(zip(STRATEGIES, (
        # TensorFlow's own tests make a one-worker MultiWorkerMirroredStrategy
        # over local devices with this private constructor.
        lambda: tf.distribute.MultiWorkerMirroredStrategy._from_local_devices(  # pylint: disable=protected-access
            devices),
        lambda: tf.distribute.MirroredStrategy(devices),
        lambda: tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.NcclAllReduce()),
    )))


def _child(settings_json):
    """Runs in the child: two logical CPUs, then the traces; prints JSON."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.get_logger().setLevel("ERROR")
    from lsbench import context  # pylint: disable=g-import-not-at-top
    from lsbench import fit_runs  # pylint: disable=g-import-not-at-top

    shape = fit_runs.fit_shape(context.Settings(**json.loads(settings_json)))
    counts, types = {}, {}
    for name, make_strategy in _strategies().items():
        strategy = make_strategy()
        measured = dict(zip(ROWS, (
            _one_optimizer(strategy, shape),
            _two_optimizers(strategy, shape, in_block=False),
            _two_optimizers(strategy, shape, in_block=True),
            _per_layer(strategy, shape))))
        counts[name] = {row: {form: sum(c.values()) for form, c in
                              forms.items()}
                        for row, forms in measured.items()}
        types[name] = {row: ", ".join(f"{op} {n}" for op, n in
                                      sorted(forms[OURS].items()))
                       for row, forms in measured.items()}
    print(json.dumps({"counts": counts, "types": types}))


if __name__ == "__main__":
    # lsbench, and the package of this checkout (as the runner imports it).
    sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[i])
                    for i in (2, 3)]
    _child(sys.argv[1])

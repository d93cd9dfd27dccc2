"""Every private TensorFlow, Keras and tf-keras API tf_lossscale relies on,
probed through its entry in `tf_lossscale._internal.private_api`: one test each,
failing with a message that names the API, the entry and the releases
installed.

A new release that renames, removes or changes one of these shows up here
first, by name, instead of as whatever breaks first in a user's training
run. Each test calls the entry and checks that the other library behaves as
relied on, with a tiny probe of that behaviour (so it reads as a statement
about the other library). The first tests check that every entry is probed
here and that no other module of the package imports a private module or
reaches into `tf.__internal__`.
"""

import ast
import pathlib
import re
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.helpers import training
import tf_lossscale
from tf_lossscale._internal import private_api

pytestmark = pytest.mark.usefixtures("keras_isolation")

_PACKAGE = pathlib.Path(tf_lossscale.__file__).parent


def _releases():
    return (f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
            f"tf-keras {tf_keras.__version__}")


def _relied_on(api, entry, detail):
    """Fails naming the API, its private_api entry, the installed releases
    and what changed."""
    pytest.fail(f"private API {api} (tf_lossscale._internal.private_api.{entry}) "
                f"changed on {_releases()}: {detail}", pytrace=False)


def _expect(condition, api, entry, detail):
    if not condition:
        _relied_on(api, entry, detail)


def _get(owner, name, api, entry):
    """`getattr(owner, name)`, failing with the API's name if it is gone."""
    if not hasattr(owner, name):
        _relied_on(api, entry, f"{owner!r} has no attribute {name!r}")
    return getattr(owner, name)


def _call(api, entry, function, *args, **kwargs):
    """`function(*args, **kwargs)`, failing with the API's name if the other
    library no longer has what it reaches for."""
    try:
        return function(*args, **kwargs)
    except (AttributeError, ImportError, TypeError) as error:
        _relied_on(api, entry, f"{type(error).__name__}: {error}")


def _write_checkpoint(**objects):
    return tf.train.Checkpoint(**objects).write(
        tempfile.mkdtemp() + "/checkpoint")


def _trained_plain_optimizer(optimizer):
    """`(variables, optimizer)` after one applied step."""
    variables = [tf.Variable([[1.0, 2.0]]), tf.Variable([3.0])]
    optimizer.apply_gradients(
        zip([tf.ones([1, 2]), tf.ones([1])], variables))
    return variables, optimizer


# --- The inventory -------------------------------------------------------------


def _entries():
    """The public names private_api defines (functions, classes, constants)."""
    tree = ast.parse(pathlib.Path(private_api.__file__).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets
                         if isinstance(t, ast.Name))
    return {name for name in names if not name.startswith("_")}


def test_every_entry_is_probed_here():
    source = pathlib.Path(__file__).read_text()
    unprobed = sorted(name for name in _entries()
                      if f"private_api.{name}" not in source)
    assert not unprobed, f"private_api entries without a probe: {unprobed}"


_PRIVATE_REACH = re.compile(
    r"tensorflow\.python|keras\.src|tf_keras\.src|__internal__")


def test_no_other_module_reaches_into_other_libraries():
    """Private modules and `tf.__internal__` are reached from private_api
    only; so are other libraries' private attributes: a `protected-access`
    exemption elsewhere is on the package's own objects, listed here."""
    own_protected_access = {
        "loss_scale.py": ("loss_scale._update_from_all_finite",),
        "dynamic_loss_scale.py": ("getattr(self._",),
        # Python's own frame access (the user's line for a warning).
        "checks.py": ("sys._getframe",),
        # A LossScaleGroup steps the loss scale it holds; its blocks and
        # members call on the group.
        "group.py": ("inner._xla_record", "self._loss_scale._step",
                     "self._loss_scale._eager_lock",
                     "self._loss_scale._xla_record",
                     "self._loss_scale._needs_finiteness"),
        "blocks.py": ("._open_block", "group._close_block",
                      "group._end_block"),
        "member.py": ("group._state_variables",
                      "loss_scale._needs_finiteness"),
        "loss_scaled_step.py": ("member._needs_finiteness",),
        # What a wrapper was built for, for carrying a run on (both Keras').
        "optimizer_protocol.py": ("wrapper._last_nonfinite",
                                  "wrapper._built_for"),
        # tf_lossscale.layerwise: its model's set-up, and the loss scale's
        # update from the flag.
        "model.py": ("model._set_up_scaling",),
        "transform.py": ("scaled._set_up_scaling",),
        "step.py": ("self._loss_scale._update_from_all_finite",),
    }
    reaches = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.name == "private_api.py":
            continue
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if _PRIVATE_REACH.search(line.split("#")[0]):
                reaches.append(f"{path.name}:{number}: {line.strip()}")
            # The exemption's line, or the line it precedes.
            nearby = "".join(lines[number - 1:number + 2])
            if "protected-access" in line and not any(
                    own in nearby
                    for own in own_protected_access.get(path.name, ())):
                reaches.append(f"{path.name}:{number}: {line.strip()}")
    assert not reaches, (
        "private APIs of other libraries used outside "
        "tf_lossscale._internal.private_api:\n" + "\n".join(reaches))


# --- TensorFlow --------------------------------------------------------------


def test_in_xla_context_tells_xla_contexts_apart():
    api = "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext"
    entry = "in_xla_context"
    seen = {}

    def probe(name):
        seen[name] = bool(_call(api, entry, private_api.in_xla_context))
        return tf.constant(0.0)

    tf.function(lambda: probe("xla"), jit_compile=True)()
    tf.function(lambda: probe("graph"))()
    _expect(seen == {"xla": True, "graph": False}, api, entry,
            f"tracing under jit_compile=True/False gave {seen}")


def test_track_names_children_in_checkpoints():
    api = "tf.__internal__.tracking.Trackable._track_trackable"
    entry = "track"
    owner = private_api.Trackable()
    variable = tf.Variable(2.0)
    _call(api, entry, private_api.track, owner, variable, "scale")
    children = _call(api, "trackable_children",
                     private_api.trackable_children, owner)
    _expect(children.get("scale") is variable, api, entry,
            f"trackable_children() gave {children}")
    path = _write_checkpoint(holder=owner)
    _expect(("holder/scale/.ATTRIBUTES/VARIABLE_VALUE", []) in
            tf.train.list_variables(path), api, entry,
            f"checkpoint keys {tf.train.list_variables(path)}")


def test_chooses_checkpoint_children_decides_what_is_saved():
    api = "Trackable._trackable_children overridden"
    entry = "ChoosesCheckpointChildren"

    class Holder(private_api.ChoosesCheckpointChildren, tf.Module):
        def _checkpoint_children(self, found, save_type, **kwargs):
            del kwargs
            if save_type != "checkpoint":
                return found
            return {"renamed": found["kept"]}

    holder = Holder()
    holder.kept = tf.Variable(1.0)
    holder.dropped = tf.Variable(2.0)
    keys = [name for name, _ in tf.train.list_variables(
        _write_checkpoint(holder=holder))]
    _expect("holder/renamed/.ATTRIBUTES/VARIABLE_VALUE" in keys and not any(
        "kept" in k or "dropped" in k for k in keys), api, entry,
            f"checkpoint keys {keys}")


def test_saved_tensors_saves_and_restores_its_own_tensors():
    api = "Trackable._serialize_to_tensors/_restore_from_tensors"
    entry = "SavedTensors"

    class Alias(private_api.SavedTensors):
        def __init__(self, variable):
            self.variable = variable

        def save_tensors(self):
            return {"VARIABLE_VALUE": tf.identity(self.variable)}

        def restore_tensors(self, tensors):
            return self.variable.assign(tensors["VARIABLE_VALUE"])

    saved = private_api.Trackable()
    private_api.track(saved, Alias(tf.Variable(5.0)), "alias")
    path = _write_checkpoint(holder=saved)
    restored = private_api.Trackable()
    target = tf.Variable(0.0)
    private_api.track(restored, Alias(target), "alias")
    tf.train.Checkpoint(holder=restored).read(path).assert_consumed()
    _expect(float(target) == 5.0, api, entry,
            f"the restored value is {float(target)}, not 5.0")


def test_restore_receiver_gets_unmatched_children_and_their_restore():
    api = ("Trackable._deferred_dependencies / _lookup_dependency "
           "/ _handle_deferred_dependencies and the restore coordinator")
    entry = "RestoreReceiver"
    saved = tf.Module()
    saved.child = tf.Module()
    saved.child.v = tf.Variable(3.0)
    path = _write_checkpoint(holder=saved)
    other = tf.Module()
    other.second = tf.Module()
    other.second.v = tf.Variable(4.0)
    other_path = _write_checkpoint(holder=other)
    received = []

    class Probe(private_api.RestoreReceiver):
        def children(self):
            return {}

        def receive(self, name, position):
            received.append((name, position))

    probe = Probe()
    tf.train.Checkpoint(holder=probe).read(path)
    _expect([name for name, _ in received] == ["child"], api, entry,
            f"received {received}")
    position = received[0][1]
    names = _call(api, entry, probe.saved_child_names, position, probe)
    _expect(names == ["child"], api, entry,
            f"the saved children restored into the probe: {names}")
    _expect(probe.saved_child_names(position, tf.Module()) is None, api,
            entry, "an object the restore did not reach has saved children")
    # Looked up again for another restore.
    tf.train.Checkpoint(holder=probe).read(other_path)
    _expect([name for name, _ in received] == ["child", "second"], api, entry,
            f"received {received}")
    names = probe.saved_child_names(received[-1][1], probe)
    _expect(names == ["second"], api, entry,
            f"the next restore's saved children: {names}")


def test_defer_restores_restores_now_or_when_the_dependency_comes():
    api = ("Trackable._deferred_dependencies / _lookup_dependency "
           "/ _handle_deferred_dependencies")
    entry = "defer_restores"
    saved = tf.Module()
    saved.child = tf.Module()
    saved.child.v = tf.Variable(3.0)
    path = _write_checkpoint(holder=saved)

    def unmatched_position():
        # A restore into an object without `child` leaves it pending there.
        holder = tf.Module()
        holder.other = tf.Variable(0.0)  # Tracking starts with a dependency.
        tf.train.Checkpoint(holder=holder).read(path)
        pending = _call(api, "pending_restores", private_api.pending_restores,
                        holder)
        _expect(list(pending) == ["child"], api, "pending_restores",
                f"pending: {dict(pending)}")
        positions = pending.pop("child")
        _expect(not private_api.pending_restores(holder), api,
                "pending_restores", "popping an entry left it pending")
        return positions

    later = tf.Module()
    later.other = tf.Variable(0.0)
    _call(api, entry, private_api.defer_restores, later, "late",
          unmatched_position())
    _expect(list(private_api.pending_restores(later)) == ["late"], api, entry,
            f"pending: {dict(private_api.pending_restores(later))}")
    late = tf.Module()
    late.v = tf.Variable(0.0)
    later.late = late
    _expect(float(late.v) == 3.0 and not private_api.pending_restores(later),
            api, entry, "the pending child was not restored when tracked "
            f"(value {float(late.v)})")
    now = tf.Module()
    now.late = tf.Module()
    now.late.v = tf.Variable(0.0)
    private_api.defer_restores(now, "late", unmatched_position())
    _expect(float(now.late.v) == 3.0 and not private_api.pending_restores(now),
            api, entry, "the child it already has was not restored "
            f"(value {float(now.late.v)})")


def test_delegating_trackable_mixin_puts_dependencies_on_the_inner_object():
    api = "tf.__internal__.tracking.DelegatingTrackableMixin"
    entry = "DelegatingTrackableMixin"

    class Wrapper(private_api.DelegatingTrackableMixin):
        @private_api.no_automatic_dependency_tracking
        def __init__(self, inner):
            private_api.DelegatingTrackableMixin.__init__(self, inner)
            self.untracked = tf.Variable(1.0)

    inner = tf.Module()
    inner.v = tf.Variable(4.0)
    wrapper = Wrapper(inner)
    private_api.track(wrapper, tf.Variable(2.0), "extra")
    children = private_api.trackable_children(inner)
    _expect("extra" in children and "v" in children, api, entry,
            f"the inner object's dependencies are {sorted(children)}")
    _expect("untracked" not in children, api + ".no_automatic_dependency"
            "_tracking", "no_automatic_dependency_tracking",
            "an attribute set under it was tracked")


def test_tensor_like_is_a_tensor_and_fetches_in_a_session():
    api = "is_tensor_like (tf.is_tensor) / _as_graph_element (Session.run)"
    entry = "TensorLike"

    class Reads(private_api.TensorLike):
        def __init__(self, tensor=None):
            self.tensor = tensor

        def _graph_read(self):
            return self.tensor

    _expect(tf.is_tensor(Reads()), api, entry, "tf.is_tensor is False")
    with tf.Graph().as_default():
        reads = Reads(tf.constant(7.0))
        fetched = tf.compat.v1.Session().run(reads)
    _expect(fetched == 7.0, api, entry, f"Session.run fetched {fetched!r}")


def test_tf1_loss_scale_variables_lists_them():
    api = "tf.compat.v1.mixed_precision.LossScale._weights"
    entry = "tf1_loss_scale_variables"
    variables = _call(api, entry, private_api.tf1_loss_scale_variables,
                      tf.compat.v1.mixed_precision.DynamicLossScale())
    names = sorted(v.name.split(":")[0].split("/")[-1] for v in variables)
    _expect(names == ["current_loss_scale", "good_steps"], api, entry,
            f"its variables are {names}")


def test_tf1_use_locking_reads_back():
    api = "tf.compat.v1.train.Optimizer._use_locking"
    entry = "tf1_use_locking"
    for use_locking in (False, True):
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(
            0.1, use_locking=use_locking)
        got = _call(api, entry, private_api.tf1_use_locking, optimizer)
        _expect(got is use_locking, api, entry,
                f"use_locking={use_locking} reads back as {got}")


def test_variable_key_is_one_for_all_replicas():
    api = "Variable._unique_id (of a MirroredVariable: its primary's)"
    entry = "variable_key"
    strategy = training.mirrored(2)
    with strategy.scope():
        first, second = tf.Variable(1.0), tf.Variable(2.0)
    keys = [_call(api, entry, private_api.variable_key, v)
            for v in (first, second, tf.Variable(3.0))]
    _expect(len(set(keys)) == 3, api, entry, f"keys {keys}")
    seen = []

    # In a step, the variables come back from merge_call as the same
    # MirroredVariable objects, which the keys are taken from.
    def step():
        def merge(_, variable):
            seen.append(private_api.variable_key(variable))
        tf.distribute.get_replica_context().merge_call(merge, args=(first,))

    strategy.run(step)
    _expect(seen == [keys[0]], api, entry,
            f"in merge_call the key is {seen}, not {keys[0]}")


# --- Keras 3 -----------------------------------------------------------------


def test_keras_optimizer_lists_its_variables_and_their_positions():
    api = "keras Optimizer._variables/_trainable_variables/_get_variable_index"
    variables, optimizer = _trained_plain_optimizer(keras.optimizers.Adam())
    own = _call(api, "keras_own_variables", private_api.keras_own_variables,
                optimizer)
    _expect([id(v) for v in own] == [id(v) for v in optimizer.variables],
            api, "keras_own_variables",
            "_variables is not the list `variables` copies")
    _expect(own[0] is optimizer.iterations, api, "keras_own_variables",
            "_variables does not start with iterations")
    built_for = _call(api, "keras_built_for", private_api.keras_built_for,
                      optimizer)
    _expect([id(v) for v in built_for] == [id(v) for v in variables], api,
            "keras_built_for", "_trainable_variables is not the built-for list")
    positions = [_call(api, "keras_variable_index",
                       private_api.keras_variable_index, optimizer, v)
                 for v in reversed(variables)]
    _expect(positions == [1, 0], api, "keras_variable_index",
            f"build positions {positions}")


def test_keras_apply_summed_passes_over_the_backend_all_reduce():
    api = "keras TFOptimizer._all_reduce_sum_gradients"
    strategy = training.mirrored(2)
    with strategy.scope():
        variable = keras.Variable([0.0])
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([variable])

    def step(apply):
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            # Replica 0's gradient is 1, replica 1's is 2.
            apply([tf.cast(replica + 1, tf.float32) * tf.ones([1])])
        tf.function(lambda: strategy.run(replica_step))()
        return [float(local.numpy()[0])
                for local in strategy.experimental_local_results(variable.value)]

    passed_over = step(lambda grads: _call(
        api, "keras_apply_summed", private_api.keras_apply_summed, optimizer,
        grads, [variable]))
    _expect(passed_over == [-1.0, -2.0], api, "keras_apply_summed",
            f"each replica should apply its own gradient, got {passed_over}")
    # Outside it, the optimizer sums across the replicas as before.
    summed = step(lambda grads: optimizer.apply(grads, [variable]))
    _expect(summed == [-4.0, -5.0], api, "keras_apply_summed",
            f"apply no longer sums the replicas' gradients: {summed}")


def test_tf1_apply_summed_passes_over_distributed_apply_sum():
    api = "tf.compat.v1.train.Optimizer._distributed_apply"
    strategy = training.mirrored(2)
    graph = tf.Graph()
    with graph.as_default(), strategy.scope():
        variable = tf.Variable([0.0])
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(1.0)

        def step(apply):
            def replica_step():
                context = tf.distribute.get_replica_context()
                # Replica 0's gradient is 1, replica 1's is 2.
                grad = tf.cast(context.replica_id_in_sync_group + 1,
                               tf.float32) * tf.ones([1])
                return apply([(grad, variable)])
            return strategy.group(strategy.run(replica_step))

        passed_over = step(lambda pairs: _call(
            api, "tf1_apply_summed", private_api.tf1_apply_summed, optimizer,
            pairs))
        summed = step(optimizer.apply_gradients)
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            locals_ = strategy.experimental_local_results(variable)
            session.run(passed_over)
            after_passed_over = [float(v[0]) for v in session.run(locals_)]
            session.run(summed)
            after_summed = [float(v[0]) for v in session.run(locals_)]
    _expect(after_passed_over == [-1.0, -2.0], api, "tf1_apply_summed",
            f"each replica should apply its own gradient: {after_passed_over}")
    _expect(after_summed == [-4.0, -5.0], api, "tf1_apply_summed",
            f"apply_gradients no longer sums across replicas: {after_summed}")


def test_keras_optimizer_checkpoint_dependency_names():
    api = ("keras Optimizer checkpoint names _iterations, _learning_rate, "
           "_variables")
    entry = "KERAS_ITERATIONS"
    _, optimizer = _trained_plain_optimizer(keras.optimizers.SGD(0.1))
    children = private_api.trackable_children(optimizer)
    _expect(children.get(private_api.KERAS_ITERATIONS) is
            optimizer.iterations, api, entry,
            f"{private_api.KERAS_ITERATIONS} is "
            f"{children.get(private_api.KERAS_ITERATIONS)!r}")
    _expect(children.get(private_api.KERAS_LEARNING_RATE) is _get(
        optimizer, private_api.KERAS_LEARNING_RATE, api,
        "KERAS_LEARNING_RATE"), api, "KERAS_LEARNING_RATE",
            "it is not the learning rate variable")
    entries = list(children.get(private_api.KERAS_VARIABLES, ()))
    _expect([id(v) for v in entries] == [id(v) for v in optimizer.variables],
            api, "KERAS_VARIABLES", "it does not list every variable in order")


def test_keras_optimizer_restores_pending_slots_when_built():
    api = ("keras Optimizer._deferred_dependencies/_lookup_dependency/"
           "_handle_deferred_dependencies")
    entry = "pending_restores"
    variables, saved = _trained_plain_optimizer(keras.optimizers.Adam(0.1))
    path = _write_checkpoint(optimizer=saved)

    def unbuilt_receiving():
        receiving = keras.optimizers.Adam(0.1)
        tf.train.Checkpoint(optimizer=receiving).read(path)
        return receiving

    def expect_restored(receiving, how):
        for restored, original in zip(receiving.variables, saved.variables):
            _expect(np.array_equal(restored.numpy(), original.numpy()), api,
                    entry, f"{restored.path} was not restored {how}")

    receiving = unbuilt_receiving()
    pending = _call(api, entry, private_api.pending_restores, receiving)
    # Slots wait under their lists' names (Adam: `_momentums` and
    # `_velocities`).
    lists = [name for name in pending
             if name != private_api.KERAS_ITERATIONS]
    _expect(lists, api, entry, "no restore pending on the unbuilt optimizer")
    entries = private_api.keras_own_variables(receiving)
    _expect(private_api.pending_restores(entries) is not None, api, entry,
            "the _variables list has no pending restores")
    receiving.build(variables)
    expect_restored(receiving, "when built")
    # Handed to an optimizer built already: restored at once (defer_restores
    # looks the dependency up on a Keras optimizer).
    built = keras.optimizers.Adam(0.1)
    built.build(variables)
    waiting = private_api.pending_restores(unbuilt_receiving())
    for name in list(waiting):
        private_api.defer_restores(built, name, waiting.pop(name))
    # Only the slot lists were pending: iterations restores at read time.
    built.iterations.assign(saved.iterations)
    expect_restored(built, "into the built optimizer")


def test_keras_load_own_variables_once_is_what_keras_saving_calls(tmp_path):
    api = "keras saving: optimizer.load_own_variables looked up on the instance"
    entry = "keras_load_own_variables_once"
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1, momentum=0.5), "mse")
    model.train_on_batch(np.ones((2, 2)), np.ones((2, 1)))
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    calls = []
    optimizer = model.optimizer
    private_api.keras_load_own_variables_once(
        optimizer, lambda store: calls.append(len(store.keys())))
    model.load_weights(path)
    _expect(calls == [len(optimizer.variables)], api, entry,
            f"the instance's hook saw {calls}")
    model.load_weights(path)
    _expect(calls == [len(optimizer.variables)], api, entry,
            f"the hook was called again: {calls}")


def test_keras_loss_scale_optimizer_subclass_without_its_init_is_kept():
    api = "keras.optimizers.LossScaleOptimizer subclassed, __init__ skipped"
    entry = "init_without_keras_loss_scale_optimizer"

    class Wrapper(keras.optimizers.LossScaleOptimizer):
        def __init__(self, inner):  # pylint: disable=super-init-not-called
            _call(api, entry,
                  private_api.init_without_keras_loss_scale_optimizer, self,
                  "wrapper")
            self.inner_optimizer = inner

    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    wrapper = Wrapper(keras.optimizers.SGD(0.1))
    model.compile(wrapper, "mse")
    _expect(model.optimizer is wrapper, api, entry,
            f"compile under mixed_float16 replaced it by {model.optimizer!r}")


# --- tf-keras ----------------------------------------------------------------


def test_tf_keras_loss_scale_optimizer_classes_delegate_to_the_inner_one():
    api = "tf_keras.src.mixed_precision.loss_scale_optimizer"
    entry = "tf_keras_loss_scale_optimizers"
    module = _call(api, entry, private_api.tf_keras_loss_scale_optimizers)
    public = tf_keras.mixed_precision.LossScaleOptimizer
    kinds = {"LossScaleOptimizerV3": tf_keras.optimizers.SGD(0.5),
             "LossScaleOptimizer": tf_keras.optimizers.legacy.SGD(0.5)}
    base = _get(module, "BaseLossScaleOptimizer", api, entry)
    for class_name, inner in kinds.items():
        klass = _get(module, class_name, api, entry)

        def __init__(self, inner):
            # As tf_keras_optimizer does: the inner optimizer first (the
            # legacy class's __setattr__ reads it), tf-keras' __init__ skipped.
            self._optimizer = inner
            private_api.DelegatingTrackableMixin.__init__(self, inner)

        if class_name == "LossScaleOptimizerV3":
            __init__ = private_api.no_automatic_dependency_tracking(__init__)
        wrapper = type("Wrapper", (klass,), {"__init__": __init__})(inner)
        _expect(isinstance(wrapper, public) and isinstance(wrapper, base),
                api, entry, f"{class_name} is not a "
                "tf.keras.mixed_precision.LossScaleOptimizer")
        _expect(wrapper.iterations is inner.iterations and
                float(wrapper.learning_rate) == 0.5, api, entry,
                f"{class_name} does not delegate to _optimizer")


def test_tf_keras_fake_optimizer_for_restoration_restores_tf22_slots():
    api = ("tf_keras.src.mixed_precision.loss_scale_optimizer."
           "FakeOptimizerForRestoration")
    entry = "tf_keras_loss_scale_optimizers"
    variable = tf.Variable([1.0, 2.0])
    saved_inner = tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9)
    saved_inner.apply_gradients([(tf.constant([1.0, 1.0]), variable)])
    # TF 2.2's layout: the inner optimizer (with its slots) under
    # `base_optimizer`.
    path = _write_checkpoint(optimizer=tf.train.Checkpoint(
        base_optimizer=saved_inner), variable=variable)
    inner = tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9)
    holder = private_api.Trackable()
    module = _call(api, entry, private_api.tf_keras_loss_scale_optimizers)
    placeholder = _call(api, entry, _get(
        module, "FakeOptimizerForRestoration", api, entry), inner)
    private_api.track(holder, placeholder, "base_optimizer")
    tf.train.Checkpoint(optimizer=holder, variable=variable).read(path)
    inner.apply_gradients([(tf.constant([0.0, 0.0]), variable)])
    slot = inner.get_slot(variable, "momentum").numpy()
    expected = saved_inner.get_slot(variable, "momentum").numpy() * 0.9
    _expect(np.allclose(slot, expected), api, entry,
            f"the restored momentum then one step is {slot}, not {expected}")


def test_tf_keras_marks_and_refuses_optimizers_it_already_wraps():
    api = "tf_keras inner optimizer's _is_wrapped_by_loss_scale_optimizer"
    entry = "TF_KERAS_WRAPPED"
    inner = tf_keras.optimizers.SGD(0.1)
    tf_keras.mixed_precision.LossScaleOptimizer(inner)
    _expect(getattr(inner, private_api.TF_KERAS_WRAPPED, False) is True, api,
            entry, "tf-keras' wrapper no longer sets it")
    flagged = tf_keras.optimizers.SGD(0.1)
    _expect(not getattr(flagged, private_api.TF_KERAS_WRAPPED, False), api,
            entry, "a fresh optimizer reads as wrapped")
    setattr(flagged, private_api.TF_KERAS_WRAPPED, True)
    with pytest.raises(ValueError):
        tf_keras.mixed_precision.LossScaleOptimizer(flagged)


def test_tf_keras_legacy_optimizer_creates_its_slots_on_demand():
    api = "tf_keras legacy OptimizerV2._create_all_weights"
    entry = "tf_keras_create_all_weights"
    optimizer = tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9)
    variables = [tf.Variable([1.0, 2.0]), tf.Variable(3.0)]
    _call(api, entry, private_api.tf_keras_create_all_weights, optimizer,
          variables)
    slots = [optimizer.get_slot(v, "momentum") for v in variables]
    _expect([tuple(s.shape) for s in slots] == [(2,), ()], api, entry,
            f"slots after _create_all_weights: {slots}")


def test_tf_keras_aggregate_legacy_aggregates_across_replicas():
    api = ("tf_keras legacy OptimizerV2._transform_unaggregated_gradients/"
           "_aggregate_gradients")
    entry = "tf_keras_aggregate_legacy"
    strategy = training.mirrored(2)
    with strategy.scope():
        variable = tf.Variable([0.0, 0.0])
        optimizer = tf_keras.optimizers.legacy.SGD(0.1)

    def step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        grad = tf.fill([2], tf.cast(replica, tf.float32) + 1.0)
        pairs = _call(api, entry, private_api.tf_keras_aggregate_legacy,
                      optimizer, [(grad, variable)])
        return pairs[0][0]

    results = [r.numpy().tolist() for r in strategy.experimental_local_results(
        strategy.run(tf.function(step)))]
    _expect(results == [[3.0, 3.0], [3.0, 3.0]], api, entry,
            f"per-replica aggregates {results}, not the sum [3, 3]")


# --- Keras 3 and tf-keras ------------------------------------------------------


@pytest.mark.parametrize("module", [keras, tf_keras], ids=["keras", "tf_keras"])
def test_flatten_layers_walks_into_the_layers_a_layer_makes(module):
    api = f"{module.__name__} Layer._flatten_layers"
    entry = "flatten_layers"
    inputs = module.Input((4, 8))
    attention = module.layers.MultiHeadAttention(2, 4, name="attention")
    block = module.Sequential([module.layers.Dense(8, name="inner")],
                              name="block")
    block(attention(inputs, inputs))

    found = list(_call(api, entry, private_api.flatten_layers, attention))
    # The layer first, then the dense layers it made for its projections.
    _expect(found and found[0] is attention, api, entry,
            f"the walk does not start at the layer: {found}")
    _expect(sum(isinstance(layer, module.layers.EinsumDense)
                for layer in found) == 4, api, entry,
            f"the walk misses the attention's projections: {found}")
    nested = list(private_api.flatten_layers(block))
    _expect(nested[0] is block and block.layers[0] in nested, api, entry,
            f"the walk misses a model's layers: {nested}")

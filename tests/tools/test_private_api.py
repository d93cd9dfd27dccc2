"""Every private TensorFlow, Keras and tf-keras API tf_lossscale relies on,
probed: one test each, failing with a message that names the API and the
tf_lossscale module that depends on it.

A new release that renames, removes or changes one of these shows up here
first, by name, instead of as whatever breaks first in a user's training
run. Each test checks that the thing exists and behaves as relied on, with a
tiny probe of that behaviour, without going through tf_lossscale's own code
(so it reads as a statement about the other library).

Checked on TensorFlow 2.16.2 and 2.21.0, Keras 3.10.0 (the oldest supported,
with TensorFlow 2.16.2) and 3.15.1, tf-keras 2.16.0 and 2.21.0.

The inventory (a draft of the future `tf_lossscale/private_api.py`
docstring; "module" is the tf_lossscale module that relies on it):

| # | private API | module | relied on for |
|---|---|---|---|
| 1 | `tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext` | xla_checks | knowing, while tracing, that a step is XLA-compiled |
| 2 | `tf.__internal__.tracking.Trackable` with `_track_trackable`, `_trackable_children` | loss_scale, keras_optimizer, tf1_optimizer, tf_keras_optimizer, optimizer_saving | named checkpoint dependencies (`loss_scale`, `current_loss_scale`, `base_optimizer`) |
| 3 | `Trackable._serialize_to_tensors` / `_restore_from_tensors` | optimizer_saving (`_Alias`) | saving an inner variable under a plain name; ignoring 0.1.0's placeholders |
| 4 | restore: `_deferred_dependencies.setdefault(name, []).append(position)`, `_lookup_dependency`, `_handle_deferred_dependencies`, `position.checkpoint` (`restore_uid`, `object_by_proto_id`, `object_graph_proto`) | optimizer_saving (`_PlainVariables`, `hand_pending_restores_to_inner`) | plain checkpoints restored into a wrapper before it is built |
| 5 | `tf.__internal__.tracking.DelegatingTrackableMixin`, `no_automatic_dependency_tracking` | tf_keras_optimizer | tf-keras' checkpoint layout (dependencies are the inner optimizer's) |
| 6 | `tf.compat.v1.mixed_precision.LossScale._weights` | tf1_optimizer | listing a TensorFlow loss scale's variables |
| 7 | `tf.compat.v1.train.Optimizer._use_locking` | tf1_optimizer | the wrapper takes the wrapped optimizer's `use_locking` |
| 8 | variables' `_unique_id` (a MirroredVariable's is its primary's); `_distributed_container()` | tf_keras_optimizer (`_key`) | one key per variable for the overflow flags' positions (the `_distributed_container` branch is never taken since TF 2.16: components keep it on `.handle`) |
| 9 | `strategy.extended.call_for_each_replica` (documented for `tf.compat.v1` only) | distribution | running a function in every replica from cross-replica context |
| 10 | Keras `Optimizer._variables`, `_trainable_variables`, `_get_variable_index` | keras_optimizer, optimizer_saving | the wrapper's own variables; positions of the overflow flags |
| 11 | Keras `Optimizer` checkpoint dependency names `_iterations`, `_learning_rate`, `_variables` | optimizer_saving | plain optimizers' checkpoint layout, written and read by the wrapper |
| 12 | Keras optimizer restores pending on `_deferred_dependencies` (slot lists, `_variables` list indices) until built | optimizer_saving | handing a wrapper's pending restores to the inner optimizer |
| 13 | Keras saving calls `optimizer.load_own_variables(store)` through the instance | optimizer_saving (`_expect_empty_inner_store`) | a one-call hook in the inner optimizer's `__dict__` |
| 14 | `keras.optimizers.LossScaleOptimizer` subclassed with its `__init__` skipped | keras_optimizer | `compile` under `mixed_float16` keeps the wrapper (isinstance) without Keras' scale variables |
| 15 | Keras 3 and tf-keras `fit`/`train_on_batch` frames (`self`, `callbacks`) and a reassigned `model.train_function` | xla_checks (`_running_trainer`, `_engage_running_trainer`) | engaging the host-side XLA checks without a callback |
| 16 | `tf_keras.src.mixed_precision.loss_scale_optimizer` (`BaseLossScaleOptimizer`, `LossScaleOptimizerV3`, `LossScaleOptimizer`) delegating through `_optimizer`; its `__init__` skipped | tf_keras_optimizer | being a `tf.keras.mixed_precision.LossScaleOptimizer` for tf-keras' `compile` and Model Garden |
| 17 | tf-keras' `_is_wrapped_by_loss_scale_optimizer` flag on the inner optimizer | tf_keras_optimizer | refusing an optimizer tf-keras' wrapper already wraps, and being refused by it |
| 18 | tf-keras legacy `OptimizerV2._create_all_weights` | tf_keras_optimizer | building a legacy inner optimizer's slots before the first step |
"""

import inspect
import sys
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.support import strategies

pytestmark = pytest.mark.usefixtures("keras_isolation")


def _relied_on(api, module, detail):
    """Fails naming the API, the dependent module and what changed."""
    pytest.fail(f"private API {api} (relied on by tf_lossscale.{module}) "
                f"changed: {detail}", pytrace=False)


def _expect(condition, api, module, detail):
    if not condition:
        _relied_on(api, module, detail)


def _get(owner, name, api, module):
    """`getattr(owner, name)`, failing with the API's name if it is gone."""
    if not hasattr(owner, name):
        _relied_on(api, module, f"{owner!r} has no attribute {name!r}")
    return getattr(owner, name)


def _write_checkpoint(**objects):
    return tf.train.Checkpoint(**objects).write(
        tempfile.mkdtemp() + "/checkpoint")


def _trained_plain_optimizer(optimizer):
    """`(variables, optimizer)` after one applied step."""
    variables = [tf.Variable([[1.0, 2.0]]), tf.Variable([3.0])]
    optimizer.apply_gradients(
        zip([tf.ones([1, 2]), tf.ones([1])], variables))
    return variables, optimizer


# --- TensorFlow --------------------------------------------------------------


def test_control_flow_util_tells_xla_contexts_apart():
    api = "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext"
    try:
        from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
    except ImportError as error:
        _relied_on(api, "xla_checks", f"cannot import it: {error}")
    in_xla = _get(control_flow_util, "GraphOrParentsInXlaContext", api,
                  "xla_checks")
    seen = {}

    def probe(name):
        seen[name] = bool(in_xla(tf.compat.v1.get_default_graph()))
        return tf.constant(0.0)

    tf.function(lambda: probe("xla"), jit_compile=True)()
    tf.function(lambda: probe("graph"))()
    _expect(seen == {"xla": True, "graph": False}, api, "xla_checks",
            f"tracing under jit_compile=True/False gave {seen}")


def test_trackable_tracks_named_children_into_checkpoints():
    api = "tf.__internal__.tracking.Trackable._track_trackable"
    modules = "loss_scale (also keras_optimizer, tf1_optimizer)"
    base = tf.__internal__.tracking.Trackable
    owner = base()
    variable = tf.Variable(2.0)
    _get(owner, "_track_trackable", api, modules)(variable, name="scale")
    children = dict(owner._trackable_children("checkpoint"))  # pylint: disable=protected-access
    _expect(children.get("scale") is variable, api, modules,
            f"_trackable_children() gave {children}")
    path = _write_checkpoint(holder=owner)
    _expect(("holder/scale/.ATTRIBUTES/VARIABLE_VALUE", []) in
            tf.train.list_variables(path), api, modules,
            f"checkpoint keys {tf.train.list_variables(path)}")


def test_trackable_serializes_and_restores_its_own_tensors():
    api = "Trackable._serialize_to_tensors/_restore_from_tensors"
    module = "optimizer_saving"

    class Alias(tf.__internal__.tracking.Trackable):
        def __init__(self, variable):
            self.variable = variable

        def _serialize_to_tensors(self):
            return {"VARIABLE_VALUE": tf.identity(self.variable)}

        def _restore_from_tensors(self, restored_tensors):
            return self.variable.assign(restored_tensors["VARIABLE_VALUE"])

    saved = tf.__internal__.tracking.Trackable()
    saved._track_trackable(Alias(tf.Variable(5.0)), name="alias")  # pylint: disable=protected-access
    path = _write_checkpoint(holder=saved)
    restored = tf.__internal__.tracking.Trackable()
    target = tf.Variable(0.0)
    restored._track_trackable(Alias(target), name="alias")  # pylint: disable=protected-access
    tf.train.Checkpoint(holder=restored).read(path).assert_consumed()
    _expect(float(target) == 5.0, api, module,
            f"the restored value is {float(target)}, not 5.0")


def test_restore_files_unmatched_children_as_deferred_dependencies():
    api = ("Trackable._deferred_dependencies / _handle_deferred_dependencies "
           "and the restore coordinator")
    module = "optimizer_saving"
    saved = tf.Module()
    saved.child = tf.Module()
    saved.child.v = tf.Variable(3.0)
    path = _write_checkpoint(holder=saved)
    filed = []

    class Recorder(dict):
        def setdefault(self, key, default=None):
            filed.append(key)
            return super().setdefault(key, default)

    class Probe(tf.__internal__.tracking.Trackable):
        def __init__(self):
            self.pending = Recorder()

        @property
        def _deferred_dependencies(self):
            return self.pending

        def _lookup_dependency(self, name, cached_dependencies=None):
            del name, cached_dependencies
            return None

    probe = Probe()
    tf.train.Checkpoint(holder=probe).read(path)
    _expect(filed == ["child"] and len(probe.pending["child"]) == 1, api,
            module, f"unmatched child filed as {filed}, {probe.pending}")
    coordinator = _get(probe.pending["child"][0], "checkpoint", api, module)
    for name in ("restore_uid", "object_by_proto_id", "object_graph_proto"):
        _get(coordinator, name, api, module)
    bound = dict(coordinator.object_by_proto_id.items())
    names = {child.local_name for node in coordinator.object_graph_proto.nodes
             for child in node.children}
    _expect(probe in bound.values() and "child" in names, api, module,
            f"proto ids {bound}, child names {names}")
    late = tf.Module()
    late.v = tf.Variable(0.0)
    probe._handle_deferred_dependencies("child", late)  # pylint: disable=protected-access
    _expect(float(late.v) == 3.0 and "child" not in probe.pending, api,
            module, "_handle_deferred_dependencies did not restore the "
            f"pending child (value {float(late.v)})")


def test_delegating_trackable_mixin_puts_dependencies_on_the_inner_object():
    api = "tf.__internal__.tracking.DelegatingTrackableMixin"
    module = "tf_keras_optimizer"
    mixin = _get(tf.__internal__.tracking, "DelegatingTrackableMixin", api,
                 module)
    no_tracking = _get(tf.__internal__.tracking,
                       "no_automatic_dependency_tracking", api, module)

    class Wrapper(mixin):
        @no_tracking
        def __init__(self, inner):
            mixin.__init__(self, inner)
            self.untracked = tf.Variable(1.0)

    inner = tf.Module()
    inner.v = tf.Variable(4.0)
    wrapper = Wrapper(inner)
    wrapper._track_trackable(tf.Variable(2.0), "extra")  # pylint: disable=protected-access
    children = dict(inner._trackable_children("checkpoint"))  # pylint: disable=protected-access
    _expect("extra" in children and "v" in children, api, module,
            f"the inner object's dependencies are {sorted(children)}")
    _expect("untracked" not in children, api + ".no_automatic_dependency"
            "_tracking", module, "an attribute set under it was tracked")


def test_tf1_loss_scale_lists_its_variables_in_weights():
    api = "tf.compat.v1.mixed_precision.LossScale._weights"
    loss_scale = tf.compat.v1.mixed_precision.DynamicLossScale()
    weights = _get(loss_scale, "_weights", api, "tf1_optimizer")
    names = sorted(v.name.split(":")[0].split("/")[-1]
                   for v in weights.values())
    _expect(names == ["current_loss_scale", "good_steps"], api,
            "tf1_optimizer", f"_weights holds {names}")


def test_tf1_optimizer_keeps_use_locking():
    api = "tf.compat.v1.train.Optimizer._use_locking"
    for use_locking in (False, True):
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(
            0.1, use_locking=use_locking)
        _expect(_get(optimizer, "_use_locking", api, "tf1_optimizer")
                is use_locking, api, "tf1_optimizer",
                f"use_locking={use_locking} reads back as "
                f"{optimizer._use_locking}")  # pylint: disable=protected-access


def test_distributed_variables_have_one_unique_id_for_all_replicas():
    api = "Variable._unique_id (of a MirroredVariable: its primary's)"
    module = "tf_keras_optimizer"
    strategy = strategies.mirrored(2)
    with strategy.scope():
        first, second = tf.Variable(1.0), tf.Variable(2.0)
    ids = [_get(v, "_unique_id", api, module)
           for v in (first, second, tf.Variable(3.0))]
    _expect(len(set(ids)) == 3, api, module, f"unique ids {ids}")
    # In a step, the variables come back from merge_call as the same
    # MirroredVariable objects, which the keys are taken from.
    seen = []

    def step():
        def merge(_, variable):
            seen.append(variable._unique_id)  # pylint: disable=protected-access
        tf.distribute.get_replica_context().merge_call(merge, args=(first,))

    strategy.run(step)
    _expect(seen == [ids[0]], api, module,
            f"in merge_call the variable's id is {seen}, not {ids[0]}")


def test_strategy_extended_calls_a_function_in_every_replica():
    api = "tf.distribute.StrategyExtended.call_for_each_replica"
    module = "distribution"
    strategy = strategies.mirrored(2)
    call = _get(strategy.extended, "call_for_each_replica", api, module)
    _expect(list(inspect.signature(call).parameters)[:2] == ["fn", "args"],
            api, module, f"signature {inspect.signature(call)}")
    with strategy.scope():
        result = call(lambda x: x + tf.distribute.get_replica_context()
                      .replica_id_in_sync_group, args=(tf.constant(10),))
    values = [int(v) for v in strategy.experimental_local_results(result)]
    _expect(values == [10, 11], api, module, f"per-replica results {values}")


# --- Keras 3 -----------------------------------------------------------------


def test_keras_optimizer_lists_its_variables_and_their_positions():
    api = "keras Optimizer._variables/_trainable_variables/_get_variable_index"
    module = "keras_optimizer (also optimizer_saving)"
    variables, optimizer = _trained_plain_optimizer(keras.optimizers.Adam())
    own = _get(optimizer, "_variables", api, module)
    _expect([id(v) for v in own] == [id(v) for v in optimizer.variables],
            api, module, "_variables is not the list `variables` copies")
    _expect(own[0] is optimizer.iterations, api, module,
            "_variables does not start with iterations")
    trainable = _get(optimizer, "_trainable_variables", api, module)
    _expect([id(v) for v in trainable] == [id(v) for v in variables], api,
            module, "_trainable_variables is not the built-for list")
    index = _get(optimizer, "_get_variable_index", api, module)
    _expect([index(v) for v in reversed(variables)] == [1, 0], api, module,
            "_get_variable_index does not give build positions")


def test_keras_optimizer_checkpoint_dependency_names():
    api = ("keras Optimizer checkpoint names _iterations, _learning_rate, "
           "_variables")
    module = "optimizer_saving"
    _, optimizer = _trained_plain_optimizer(keras.optimizers.SGD(0.1))
    children = dict(optimizer._trackable_children("checkpoint"))  # pylint: disable=protected-access
    _expect(children.get("_iterations") is optimizer.iterations, api, module,
            f"_iterations is {children.get('_iterations')!r}")
    _expect(children.get("_learning_rate") is _get(
        optimizer, "_learning_rate", api, module), api, module,
            "_learning_rate is not the learning rate variable")
    entries = list(children.get("_variables", ()))
    _expect([id(v) for v in entries] == [id(v) for v in optimizer.variables],
            api, module, "_variables does not list every variable in order")


def test_keras_optimizer_restores_pending_slots_when_built():
    api = ("keras Optimizer._deferred_dependencies/_lookup_dependency/"
           "_handle_deferred_dependencies")
    module = "optimizer_saving"
    variables, saved = _trained_plain_optimizer(keras.optimizers.Adam(0.1))
    path = _write_checkpoint(optimizer=saved)
    receiving = keras.optimizers.Adam(0.1)
    tf.train.Checkpoint(optimizer=receiving).read(path)
    pending = _get(receiving, "_deferred_dependencies", api, module)
    # Slots wait under their lists' names (Adam: `_momentums` and
    # `_velocities`).
    lists = [name for name in pending if name not in ("_iterations",)]
    _expect(lists, api, module, "no restore pending on the unbuilt optimizer")
    entries = _get(receiving, "_variables", api, module)
    for name in ("_deferred_dependencies", "_handle_deferred_dependencies"):
        _get(entries, name, api, module)
    _expect(receiving._lookup_dependency("_iterations") is  # pylint: disable=protected-access
            receiving.iterations, api, module,
            "_lookup_dependency('_iterations') is not iterations")
    receiving.build(variables)
    for restored, original in zip(receiving.variables, saved.variables):
        _expect(np.array_equal(restored.numpy(), original.numpy()), api,
                module, f"{restored.path} was not restored when built")


def test_keras_saving_loads_optimizer_state_through_the_instance(tmp_path):
    api = "keras saving: optimizer.load_own_variables looked up on the instance"
    module = "optimizer_saving"
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1, momentum=0.5), "mse")
    model.train_on_batch(np.ones((2, 2)), np.ones((2, 1)))
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    calls = []
    optimizer = model.optimizer
    optimizer.__dict__["load_own_variables"] = lambda store: calls.append(
        len(store.keys()))
    model.load_weights(path)
    _expect(calls == [len(optimizer.variables)], api, module,
            f"the instance's hook saw {calls}")


def test_keras_loss_scale_optimizer_subclass_without_its_init_is_kept():
    api = "keras.optimizers.LossScaleOptimizer subclassed, __init__ skipped"
    module = "keras_optimizer"

    class Wrapper(keras.optimizers.LossScaleOptimizer):
        def __init__(self, inner):  # pylint: disable=super-init-not-called
            keras.optimizers.Optimizer.__init__(  # pylint: disable=non-parent-init-called
                self, learning_rate=0.0)
            self.inner_optimizer = inner

    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    wrapper = Wrapper(keras.optimizers.SGD(0.1))
    model.compile(wrapper, "mse")
    _expect(model.optimizer is wrapper, api, module,
            f"compile under mixed_float16 replaced it by {model.optimizer!r}")


class _FramesSeen:
    """What a train step, while traced inside `fit` or `train_on_batch`,
    finds on the stack, as `xla_checks._running_trainer` looks for it."""

    def __init__(self):
        self.frames = []

    def look(self, model):
        frame = sys._getframe(1)  # pylint: disable=protected-access
        while frame is not None:
            if (frame.f_code.co_name in ("fit", "train_on_batch")
                    and frame.f_locals.get("self") is model):
                callbacks = frame.f_locals.get("callbacks")
                self.frames.append((frame.f_code.co_name, hasattr(
                    callbacks, "on_train_batch_end")))
                return
            frame = frame.f_back
        self.frames.append(None)


def _check_trainer_frames(framework, api):
    module = "xla_checks"
    seen = _FramesSeen()

    class Model(framework.Model):
        def train_step(self, data):
            seen.look(self)
            return super().train_step(data)

    inputs = framework.Input((2,))
    model = Model(inputs, framework.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    x, y = np.ones((4, 2), np.float32), np.ones((4, 1), np.float32)
    model.fit(x, y, batch_size=4, verbose=0)
    # tf-keras traces the step twice in its first fit.
    _expect(seen.frames and set(seen.frames) == {("fit", True)}, api, module,
            f"while fit traced the step: {seen.frames}")
    calls = []
    compiled = model.train_function

    def train_function(*args, **kwargs):
        calls.append(1)
        return compiled(*args, **kwargs)

    model.train_function = train_function
    model.fit(x, y, batch_size=4, verbose=0)
    _expect(calls == [1], api, module,
            "a later fit did not call the reassigned model.train_function")
    model.train_function = None
    seen.frames.clear()
    model.train_on_batch(x, y)
    _expect(seen.frames[:1] == [("train_on_batch", False)], api, module,
            f"while train_on_batch traced the step: {seen.frames}")


def test_keras_fit_frames_and_train_function():
    _check_trainer_frames(
        keras, "keras Model.fit/train_on_batch frames and train_function")


# --- tf-keras ----------------------------------------------------------------


def test_tf_keras_fit_frames_and_train_function():
    _check_trainer_frames(
        tf_keras, "tf_keras Model.fit/train_on_batch frames and train_function")


def test_tf_keras_loss_scale_optimizer_classes_delegate_to_the_inner_one():
    api = "tf_keras.src.mixed_precision.loss_scale_optimizer"
    module = "tf_keras_optimizer"
    try:
        from tf_keras.src.mixed_precision import loss_scale_optimizer  # pylint: disable=g-import-not-at-top
    except ImportError as error:
        _relied_on(api, module, f"cannot import it: {error}")
    public = tf_keras.mixed_precision.LossScaleOptimizer
    kinds = {"LossScaleOptimizerV3": tf_keras.optimizers.SGD(0.5),
             "LossScaleOptimizer": tf_keras.optimizers.legacy.SGD(0.5)}
    base = _get(loss_scale_optimizer, "BaseLossScaleOptimizer", api, module)
    for class_name, inner in kinds.items():
        klass = _get(loss_scale_optimizer, class_name, api, module)

        def __init__(self, inner):
            # As tf_keras_optimizer does: the inner optimizer first (the
            # legacy class's __setattr__ reads it), tf-keras' __init__ skipped.
            self._optimizer = inner
            tf.__internal__.tracking.DelegatingTrackableMixin.__init__(
                self, inner)

        if class_name == "LossScaleOptimizerV3":
            __init__ = (tf.__internal__.tracking.
                        no_automatic_dependency_tracking(__init__))
        wrapper = type("Wrapper", (klass,), {"__init__": __init__})(inner)
        _expect(isinstance(wrapper, public) and isinstance(wrapper, base),
                api, module, f"{class_name} is not a "
                "tf.keras.mixed_precision.LossScaleOptimizer")
        _expect(wrapper.iterations is inner.iterations and
                float(wrapper.learning_rate) == 0.5, api, module,
                f"{class_name} does not delegate to _optimizer")


def test_tf_keras_marks_and_refuses_optimizers_it_already_wraps():
    api = "tf_keras inner optimizer's _is_wrapped_by_loss_scale_optimizer"
    module = "tf_keras_optimizer"
    inner = tf_keras.optimizers.SGD(0.1)
    tf_keras.mixed_precision.LossScaleOptimizer(inner)
    _expect(getattr(inner, "_is_wrapped_by_loss_scale_optimizer", None)
            is True, api, module, "tf-keras' wrapper no longer sets it")
    flagged = tf_keras.optimizers.SGD(0.1)
    flagged._is_wrapped_by_loss_scale_optimizer = True  # pylint: disable=protected-access
    with pytest.raises(ValueError):
        tf_keras.mixed_precision.LossScaleOptimizer(flagged)


def test_tf_keras_legacy_optimizer_creates_its_slots_on_demand():
    api = "tf_keras legacy OptimizerV2._create_all_weights"
    module = "tf_keras_optimizer"
    optimizer = tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9)
    variables = [tf.Variable([1.0, 2.0]), tf.Variable(3.0)]
    _get(optimizer, "_create_all_weights", api, module)(variables)
    slots = [optimizer.get_slot(v, "momentum") for v in variables]
    _expect([tuple(s.shape) for s in slots] == [(2,), ()], api, module,
            f"slots after _create_all_weights: {slots}")

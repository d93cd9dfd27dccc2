"""Every private TensorFlow, Keras and tf-keras API tf_lossscale relies on.

The rest of the package calls the functions and classes here instead of
reaching into other libraries: when a release renames, removes or changes
one of these, this module is where it shows, and
`tests/tools/test_private_api.py` fails naming the entry and the releases
installed.

Each entry says what it relies on and the releases it was checked on. All
were checked on TensorFlow 2.16.2 and 2.21.0, Keras 3.10.0 and 3.15.1,
tf-keras 2.16.0 and 2.21.0, unless the entry says otherwise.

| entry | relies on | used by |
|---|---|---|
| `in_xla_context` | `tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext` | xla_record |
| `Trackable`, `track`, `trackable_children` | `tf.__internal__.tracking.Trackable`, `_track_trackable`, `_trackable_children` | loss_scale, keras_optimizer, tf_keras_optimizer, tf1_optimizer, optimizer_saving |
| `ChoosesCheckpointChildren` | overriding `Trackable._trackable_children` | keras_optimizer |
| `SavedTensors` | overriding `Trackable._serialize_to_tensors` / `_restore_from_tensors` | optimizer_saving |
| `RestoreReceiver`, `restore_uid`, `saved_child_names` | `_deferred_dependencies.setdefault(name, []).append(position)`, `_lookup_dependency`, the restore coordinator (`restore_uid`, `object_by_proto_id`, `object_graph_proto`) | optimizer_saving |
| `pending_restores`, `defer_restores`, `dependency`, `restore_deferred` | `_deferred_dependencies`, `_lookup_dependency`, `_handle_deferred_dependencies` (on Keras optimizers and their `_variables` list too) | optimizer_saving |
| `DelegatingTrackableMixin`, `no_automatic_dependency_tracking` | `tf.__internal__.tracking` | tf_keras_optimizer |
| `TensorLike` | `is_tensor_like` (`tf.is_tensor`), `_as_graph_element` (`Session.run`) | scale_reading |
| `tf1_loss_scale_variables` | `tf.compat.v1.mixed_precision.LossScale._weights` | tf1_optimizer |
| `tf1_use_locking` | `tf.compat.v1.train.Optimizer._use_locking` | tf1_optimizer |
| `variable_key` | `Variable._unique_id` (a MirroredVariable's is its primary's), `_distributed_container()` | tf_keras_optimizer |
| `call_for_each_replica` | `StrategyExtended.call_for_each_replica` (documented for `tf.compat.v1` only) | distribution |
| `keras_own_variables`, `keras_built_for`, `keras_variable_index` | Keras `Optimizer._variables`, `_trainable_variables`, `_get_variable_index` | keras_optimizer, optimizer_saving |
| `KERAS_ITERATIONS`, `KERAS_LEARNING_RATE`, `KERAS_VARIABLES` | Keras `Optimizer` checkpoint dependency names | optimizer_saving |
| `keras_load_own_variables_once` | Keras saving calls `optimizer.load_own_variables(store)` looked up on the instance | optimizer_saving |
| `init_without_keras_loss_scale_optimizer` | `keras.optimizers.LossScaleOptimizer` subclassed with its `__init__` skipped | keras_optimizer |
| `tf_keras_loss_scale_optimizers` | `tf_keras.src.mixed_precision.loss_scale_optimizer` (`BaseLossScaleOptimizer`, `LossScaleOptimizerV3`, `LossScaleOptimizer`) delegating through `_optimizer` | tf_keras_optimizer |
| `tf_keras_fake_optimizer_for_restoration` | `FakeOptimizerForRestoration` of that module | tf_keras_optimizer |
| `tf_keras_mark_wrapped`, `tf_keras_is_wrapped` | the inner optimizer's `_is_wrapped_by_loss_scale_optimizer` | tf_keras_optimizer, tf_keras_arguments |
| `tf_keras_create_all_weights` | legacy `OptimizerV2._create_all_weights` | tf_keras_optimizer |
| `tf_keras_aggregate_legacy` | legacy `OptimizerV2._transform_unaggregated_gradients`, `_aggregate_gradients` | tf_keras_optimizer |

tf_keras is imported only by the tf-keras entries, when called.
"""

# pylint: disable=protected-access

import functools
import types

import tensorflow as tf
# Private TensorFlow API: the only way to tell, while tracing, whether ops
# are compiled by XLA.
from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import


# --- TensorFlow: tracing ------------------------------------------------------


def in_xla_context():
    """Whether ops built now are compiled by XLA (checked while tracing).

    Relies on `control_flow_util.GraphOrParentsInXlaContext`.
    """
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())


# --- TensorFlow: checkpoint dependencies --------------------------------------

# The base of objects with named checkpoint dependencies (`tf.__internal__`).
Trackable = tf.__internal__.tracking.Trackable

# tf-keras' checkpoint layout: a wrapper whose dependencies are the inner
# object's; and attribute assignment that tracks nothing (`tf.__internal__`).
DelegatingTrackableMixin = tf.__internal__.tracking.DelegatingTrackableMixin
no_automatic_dependency_tracking = (
    tf.__internal__.tracking.no_automatic_dependency_tracking)


def track(owner, child, name):
    """Makes `child` the checkpoint dependency `name` of `owner` (a
    `Trackable`), whatever attribute holds it. `Trackable._track_trackable`.
    """
    owner._track_trackable(child, name=name)


def trackable_children(owner, save_type="checkpoint", **kwargs):
    """`{name: child}`: the checkpoint dependencies of `owner`.
    `Trackable._trackable_children`."""
    return dict(owner._trackable_children(save_type, **kwargs))


class ChoosesCheckpointChildren:
    """Mixin for a `Trackable` that decides its own checkpoint dependencies:
    `_checkpoint_children(found, save_type, **kwargs)` gets those automatic
    tracking found and returns the ones to save and restore. Overrides
    `Trackable._trackable_children`."""

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        found = super()._trackable_children(save_type, **kwargs)
        return self._checkpoint_children(found, save_type, **kwargs)

    def _checkpoint_children(self, found, save_type, **kwargs):
        raise NotImplementedError


class SavedTensors(Trackable):
    """A checkpoint entry that saves and restores its own tensors: the
    subclass defines `save_tensors()` (`{name: tensor}`) and
    `restore_tensors(tensors)` (returns an op or tensor). Overrides
    `Trackable._serialize_to_tensors` / `_restore_from_tensors`."""

    def save_tensors(self):
        raise NotImplementedError

    def restore_tensors(self, tensors):
        raise NotImplementedError

    def _serialize_to_tensors(self):
        return self.save_tensors()

    def _restore_from_tensors(self, restored_tensors):
        return self.restore_tensors(restored_tensors)


class _Handover(dict):
    """TF files each checkpoint entry no dependency matched with
    `_deferred_dependencies.setdefault(name, []).append(position)`; this
    hands each to `receive(name, position)` as it is filed, keeping none."""

    def __init__(self, receive):
        super().__init__()
        self._receive = receive

    def setdefault(self, key, default=None):
        del default
        return types.SimpleNamespace(
            append=functools.partial(self._receive, key))


class RestoreReceiver(Trackable):
    """A checkpoint entry whose saved children go to `receive(name,
    position)` as a restore meets them, instead of to dependencies of its
    own: it matches none by name, so TF files each as deferred. Saving, its
    children are `children()` (`{name: trackable}`).

    Relies on `_lookup_dependency` (answering None), `_deferred_dependencies`
    and how the restore files into it; `position` is TF's
    `CheckpointPosition`, for `restore_uid`, `saved_child_names` and
    `defer_restores`.
    """

    def children(self):
        raise NotImplementedError

    def receive(self, name, position):
        raise NotImplementedError

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        del save_type, kwargs
        return self.children()

    def _lookup_dependency(self, name, cached_dependencies=None):
        del name, cached_dependencies
        return None

    @property
    def _deferred_dependencies(self):
        return _Handover(self.receive)


def restore_uid(position):
    """An id of the restore `position` belongs to (one per `restore()`):
    the coordinator's `restore_uid`."""
    return position.checkpoint.restore_uid


def saved_child_names(position, trackable):
    """The names of the saved children of the checkpoint object restored
    into `trackable` in `position`'s restore; None if none was. Reads the
    coordinator's `object_by_proto_id` and `object_graph_proto`."""
    coordinator = position.checkpoint
    for node_id, bound in list(coordinator.object_by_proto_id.items()):
        if bound is trackable:
            node = coordinator.object_graph_proto.nodes[node_id]
            return [child.local_name for child in node.children]
    return None


def pending_restores(trackable):
    """`{name: [position]}`: restores waiting on `trackable` for
    dependencies it does not have yet (`_deferred_dependencies`; taking
    entries out of it means they no longer wait there)."""
    return trackable._deferred_dependencies


def defer_restores(trackable, name, positions):
    """Makes `positions` wait on `trackable` until it has a dependency
    `name`, as if its own restore had filed them."""
    trackable._deferred_dependencies.setdefault(name, []).extend(positions)


def dependency(trackable, name):
    """`trackable`'s checkpoint dependency `name`, or None
    (`_lookup_dependency`)."""
    return trackable._lookup_dependency(name)


def restore_deferred(trackable, name, child):
    """Restores into `child`, now `trackable`'s dependency `name`, what
    waits for it (`_handle_deferred_dependencies`)."""
    trackable._handle_deferred_dependencies(name, child)


# --- TensorFlow: tensors, TF1, distribution -----------------------------------


class TensorLike:
    """Mixin: `tf.is_tensor(obj)` is True (the `is_tensor_like` attribute
    it looks for) and `Session.run(obj)` fetches `obj._graph_read()`, a
    tensor of the default graph (`_as_graph_element`, as `tf.Variable`)."""

    @property
    def is_tensor_like(self):
        return True

    def _as_graph_element(self):
        return self._graph_read()

    def _graph_read(self):
        raise NotImplementedError


def tf1_loss_scale_variables(loss_scale):
    """The variables of a `tf.compat.v1.mixed_precision.LossScale`, which
    lists them nowhere public (`_weights`)."""
    return list(loss_scale._weights.values())


def tf1_use_locking(optimizer):
    """The `use_locking` a `tf.compat.v1.train.Optimizer` was made with
    (`_use_locking`)."""
    return optimizer._use_locking


def variable_key(variable):
    """One key for a variable, whichever replica's component is at hand:
    `_unique_id` (a MirroredVariable's is its primary's). The
    `_distributed_container` branch is not taken since TF 2.16 (components
    keep it on `.handle`); it stays for older components."""
    if hasattr(variable, "_distributed_container"):
        variable = variable._distributed_container()
    return variable._unique_id


def call_for_each_replica(strategy, fn, args):
    """From cross-replica context, `fn(*args)` in every replica of
    `strategy`: `strategy.extended.call_for_each_replica`, documented for
    `tf.compat.v1` only."""
    return strategy.extended.call_for_each_replica(fn, args=args)


# --- Keras 3 ------------------------------------------------------------------

# A Keras optimizer's checkpoint dependency names (what a plain optimizer's
# checkpoint holds): its iterations, its learning rate, its variable list.
KERAS_ITERATIONS = "_iterations"
KERAS_LEARNING_RATE = "_learning_rate"
KERAS_VARIABLES = "_variables"


def keras_own_variables(optimizer):
    """A Keras optimizer's own variable list (`_variables`: what
    `variables` copies; a tracked list that restores wait on)."""
    return optimizer._variables


def keras_built_for(optimizer):
    """The variables a Keras optimizer was built for
    (`_trainable_variables`), in build order."""
    return optimizer._trainable_variables


def keras_variable_index(optimizer, variable):
    """The position of `variable` among those `optimizer` was built for
    (`_get_variable_index`; works on replica components too)."""
    return optimizer._get_variable_index(variable)


def keras_load_own_variables_once(optimizer, load):
    """The next `optimizer.load_own_variables(store)` that Keras saving
    makes calls `load(store)` instead, once.

    Relies on Keras saving looking the method up on the instance; the hook
    goes into `__dict__`, past Keras' attribute tracking (a function is no
    optimizer state), and removes itself before calling `load`.
    """
    def load_own_variables(store):
        del optimizer.__dict__["load_own_variables"]
        load(store)

    optimizer.__dict__["load_own_variables"] = load_own_variables


def init_without_keras_loss_scale_optimizer(optimizer, name):
    """Initialises a subclass of `keras.optimizers.LossScaleOptimizer` as a
    plain Keras optimizer (learning rate 0, unused), skipping that class's
    `__init__` and its scale variables: `compile` under `mixed_float16`
    keeps such an instance (isinstance) as it is."""
    import keras  # pylint: disable=g-import-not-at-top
    keras.optimizers.Optimizer.__init__(  # pylint: disable=non-parent-init-called
        optimizer, learning_rate=0.0, name=name)


# --- tf-keras -----------------------------------------------------------------


def tf_keras_loss_scale_optimizers():
    """tf-keras' `tf_keras.src.mixed_precision.loss_scale_optimizer`
    module: `BaseLossScaleOptimizer`, `LossScaleOptimizerV3` and the legacy
    `LossScaleOptimizer`, which delegate to the inner optimizer kept in
    `_optimizer` (and can be subclassed with their `__init__` skipped)."""
    from tf_keras.src.mixed_precision import loss_scale_optimizer  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
    return loss_scale_optimizer


def tf_keras_fake_optimizer_for_restoration(inner_optimizer):
    """tf-keras' placeholder that hands the slots a TF 2.2 wrapper saved
    under `base_optimizer` to `inner_optimizer` (holds no variable)."""
    return tf_keras_loss_scale_optimizers().FakeOptimizerForRestoration(
        inner_optimizer)


def tf_keras_mark_wrapped(inner_optimizer):
    """Flags `inner_optimizer` as wrapped, as tf-keras' wrapper does
    (`_is_wrapped_by_loss_scale_optimizer`): tf-keras' wrappers refuse it."""
    inner_optimizer._is_wrapped_by_loss_scale_optimizer = True


def tf_keras_is_wrapped(inner_optimizer):
    """Whether a tf-keras wrapper flagged `inner_optimizer`."""
    return bool(getattr(inner_optimizer, "_is_wrapped_by_loss_scale_optimizer",
                        False))


def tf_keras_create_all_weights(inner_optimizer, var_list):
    """Builds a legacy (OptimizerV2) optimizer's slots for `var_list` before
    its first step (`_create_all_weights`)."""
    inner_optimizer._create_all_weights(var_list)


def tf_keras_aggregate_legacy(inner_optimizer, pairs):
    """What `OptimizerV2.apply_gradients` does to `pairs` to aggregate them:
    its hook for unaggregated gradients, then its aggregation (the
    `gradient_aggregator`, unless a subclass overrides it). The methods
    tf-keras' own wrapper calls and subclasses override:
    `_transform_unaggregated_gradients`, `_aggregate_gradients`."""
    pairs = inner_optimizer._transform_unaggregated_gradients(pairs)
    return inner_optimizer._aggregate_gradients(pairs)

"""Every private TensorFlow, Keras and tf-keras API tf_lossscale relies on.

`tests/tools/test_private_api.py` probes each entry on the installed
releases. tf_keras is imported only when called.
"""

# pylint: disable=protected-access

import functools
import threading
import types

import tensorflow as tf
# The only way to tell, while tracing, whether ops are compiled by XLA.
from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import


def in_xla_context():
    """Whether ops built now are compiled by XLA (checked while tracing)."""
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())


# --- TensorFlow: checkpoint dependencies --------------------------------------
Trackable = tf.__internal__.tracking.Trackable
DelegatingTrackableMixin = tf.__internal__.tracking.DelegatingTrackableMixin
no_automatic_dependency_tracking = (
    tf.__internal__.tracking.no_automatic_dependency_tracking)


def track(owner, child, name):
    """Makes `child` the checkpoint dependency `name` of `owner`."""
    owner._track_trackable(child, name=name)


def trackable_children(owner, save_type="checkpoint", **kwargs):
    """`{name: child}`: the checkpoint dependencies of `owner`."""
    return dict(owner._trackable_children(save_type, **kwargs))


class ChoosesCheckpointChildren:
    """Mixin: a `Trackable`'s `_checkpoint_children(found, save_type,
    **kwargs)` picks its dependencies from those tracking found."""

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        found = super()._trackable_children(save_type, **kwargs)
        return self._checkpoint_children(found, save_type, **kwargs)


class SavedTensors(Trackable):
    """A checkpoint entry that saves `save_tensors()` (`{name: tensor}`) and
    restores them with `restore_tensors(tensors)`."""

    def _serialize_to_tensors(self):
        return self.save_tensors()

    def _restore_from_tensors(self, restored_tensors):
        return self.restore_tensors(restored_tensors)


class _Handover(dict):
    """Hands each restore TF defers (`setdefault(name, []).append(position)`)
    to `receive(name, position)`, keeping none."""

    def __init__(self, receive):
        super().__init__()
        self._receive = receive

    def setdefault(self, key, default=None):
        del default
        return types.SimpleNamespace(
            append=functools.partial(self._receive, key))


class RestoreReceiver(Trackable):
    """A checkpoint entry whose children are `children()` when saving; when
    restoring, each saved child goes to `receive(name, position)` (TF's
    `CheckpointPosition`), as no dependency matches it."""

    def saved_child_names(self, position, trackable):
        """The saved children's names of what `position`'s restore put into
        `trackable` (None if nothing); looked up once per restore."""
        coordinator = position.checkpoint
        key = (coordinator.restore_uid, id(trackable))
        cached = getattr(self, "_saved_child_names", (None, None))
        if cached[0] != key:
            names = None
            for node_id, bound in list(coordinator.object_by_proto_id.items()):
                if bound is trackable:
                    node = coordinator.object_graph_proto.nodes[node_id]
                    names = [child.local_name for child in node.children]
                    break
            cached = self._saved_child_names = (key, names)
        return cached[1]

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        del save_type, kwargs
        return self.children()

    def _lookup_dependency(self, name, cached_dependencies=None):
        del name, cached_dependencies
        return None

    @property
    def _deferred_dependencies(self):
        return _Handover(self.receive)


def pending_restores(trackable):
    """`{name: [position]}`: restores waiting on `trackable` for a dependency
    it does not have yet (the dict itself: popping stops the wait)."""
    return trackable._deferred_dependencies


def defer_restores(trackable, name, positions):
    """Files `positions` on `trackable` as its own restore would: restored
    now into its dependency `name` if it has one, else when it tracks one."""
    trackable._deferred_dependencies.setdefault(name, []).extend(positions)
    child = trackable._lookup_dependency(name)
    if child is not None:
        trackable._handle_deferred_dependencies(name, child)


# --- TensorFlow: tensors, TF1, distribution -----------------------------------
class TensorLike:
    """Mixin: `tf.is_tensor(obj)` is True, and `Session.run(obj)` fetches
    `obj._graph_read()`, a tensor of the default graph."""

    @property
    def is_tensor_like(self):
        return True

    def _as_graph_element(self):
        return self._graph_read()


def tf1_loss_scale_variables(loss_scale):
    """The variables of a `tf.compat.v1.mixed_precision.LossScale`."""
    return list(loss_scale._weights.values())


def tf1_use_locking(optimizer):
    """The `use_locking` a `tf.compat.v1.train.Optimizer` was made with."""
    return optimizer._use_locking


class _KeepsSums:
    """Stands for a strategy, or its `extended`, whose `batch_reduce_to`
    returns the values as given: they are sums already."""

    def __init__(self, wrapped, extended=None):
        self._wrapped = wrapped
        if extended is not None:
            self.extended = extended

    def __getattr__(self, name):
        return getattr(self._wrapped, name)

    @staticmethod
    def batch_reduce_to(reduce_op, value_destination_pairs, options=None):
        del reduce_op, options
        return [value for value, _ in value_destination_pairs]


def tf1_apply_summed(optimizer, grads_and_vars, global_step=None, name=None):
    """A TF1 optimizer's `apply_gradients`, in a replica context, of
    gradients already summed over the replicas."""
    if not tf.distribute.has_strategy():
        return optimizer.apply_gradients(grads_and_vars, global_step, name)
    pairs = [(grad, var) for grad, var in grads_and_vars if grad is not None]

    def apply(strategy, pairs):
        keeps = _KeepsSums(strategy, _KeepsSums(strategy.extended))
        return optimizer._distributed_apply(keeps, pairs, global_step, name)

    return tf.distribute.get_replica_context().merge_call(apply, args=(pairs,))


def variable_key(variable):
    """One key per variable (a MirroredVariable's is its primary's)."""
    return variable._unique_id


# --- Keras 3 ------------------------------------------------------------------
# A Keras optimizer's checkpoint dependency names.
KERAS_ITERATIONS = "_iterations"
KERAS_LEARNING_RATE = "_learning_rate"
KERAS_VARIABLES = "_variables"


def keras_own_variables(optimizer):
    """A Keras optimizer's own (tracked) list, which `variables` copies."""
    return optimizer._variables


def keras_built_for(optimizer):
    """The variables a Keras optimizer was built for, in build order."""
    return optimizer._trainable_variables


def keras_variable_index(optimizer, variable):
    """The position of `variable` (or a replica's) in `keras_built_for`."""
    return optimizer._get_variable_index(variable)


def keras_load_own_variables_once(optimizer, load):
    """The next `optimizer.load_own_variables(store)` calls `load(store)`
    instead, once (the hook sits in `__dict__`, past Keras' tracking)."""
    def load_own_variables(store):
        del optimizer.__dict__["load_own_variables"]
        load(store)

    optimizer.__dict__["load_own_variables"] = load_own_variables


# Set while `keras_apply_summed` applies, in the replica's own thread.
_APPLYING_SUMS = threading.local()


def keras_apply_summed(optimizer, grads, variables):
    """`optimizer.apply(grads, variables)` of gradients already summed over
    the replicas: its all-reduce passes them through."""
    if "_all_reduce_sum_gradients" not in optimizer.__dict__:
        sum_gradients = optimizer._all_reduce_sum_gradients

        def sum_unless_summed(grads_and_vars):
            if getattr(_APPLYING_SUMS, "active", False):
                return list(grads_and_vars)
            return sum_gradients(grads_and_vars)

        # In `__dict__`, past Keras' tracking.
        optimizer.__dict__["_all_reduce_sum_gradients"] = sum_unless_summed
    _APPLYING_SUMS.active = True
    try:
        return optimizer.apply(grads, variables)
    finally:
        _APPLYING_SUMS.active = False


def init_without_keras_loss_scale_optimizer(optimizer, name):
    """Initialises a subclass of `keras.optimizers.LossScaleOptimizer` as a
    plain optimizer (learning rate 0, unused), skipping that class's
    `__init__`."""
    import keras  # pylint: disable=g-import-not-at-top
    keras.optimizers.Optimizer.__init__(  # pylint: disable=non-parent-init-called
        optimizer, learning_rate=0.0, name=name)


# --- Keras 3 and tf-keras -----------------------------------------------------
def flatten_layers(layer):
    """`layer` and every layer it tracks, recursively, depth first (Keras
    has no public walk into the layers a layer makes itself)."""
    return layer._flatten_layers(include_self=True, recursive=True)


# --- tf-keras -----------------------------------------------------------------
# The flag tf-keras' wrappers set on the optimizer they wrap, and refuse.
TF_KERAS_WRAPPED = "_is_wrapped_by_loss_scale_optimizer"


def tf_keras_loss_scale_optimizers():
    """tf-keras' module of wrappers (`BaseLossScaleOptimizer`,
    `LossScaleOptimizerV3`, `LossScaleOptimizer`, which delegate to
    `_optimizer`) and of `FakeOptimizerForRestoration(inner)`, which hands
    `inner` the slots a TF 2.2 wrapper saved under `base_optimizer`."""
    from tf_keras.src.mixed_precision import loss_scale_optimizer  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
    return loss_scale_optimizer


def tf_keras_create_all_weights(inner_optimizer, var_list):
    """Builds a legacy (OptimizerV2) optimizer's slots for `var_list`."""
    inner_optimizer._create_all_weights(var_list)


def tf_keras_aggregate_legacy(inner_optimizer, pairs):
    """`pairs` aggregated as `OptimizerV2.apply_gradients` does."""
    pairs = inner_optimizer._transform_unaggregated_gradients(pairs)
    return inner_optimizer._aggregate_gradients(pairs)

"""How the Keras 3 `LossScaleOptimizer` saves its state, and what it restores.

The layout, and how a restore is routed: docs/guides/saving.md, "What the
files hold".
"""

import warnings
import weakref

import tensorflow as tf

from tf_lossscale._internal import private_api

# What wrappers' checkpoints hold for their own unused iterations and
# learning rate.
_PLACEHOLDER_VALUES = {private_api.KERAS_ITERATIONS: 0,
                       private_api.KERAS_LEARNING_RATE: 0.0}
_LOSS_SCALE_KEY = "loss_scale.{}"
_FLAGS_KEY = "last_nonfinite"
# The wrapper's own checkpoint dependencies.
_WRAPPER_NAMES = ("inner_optimizer", "loss_scale", "_skipped_steps")


class SavedState(private_api.ChoosesCheckpointChildren):
    """Mixin of the Keras 3 wrapper: its `variables`, files and checkpoints."""

    @property
    def variables(self):
        """All state: the wrapper's, the loss scale's, the inner optimizer's."""
        return [*private_api.keras_own_variables(self),
                *self._loss_scale.variables, *self.inner_optimizer.variables]

    def _indexed_variables(self):
        """The variables stored under "0", "1", ..."""
        return [v for v in private_api.keras_own_variables(self)
                if v is not self._last_nonfinite
                ] + list(self.inner_optimizer.variables)

    def save_own_variables(self, store):
        for index, variable in enumerate(self._indexed_variables()):
            store[str(index)] = variable.numpy()
        for index, variable in enumerate(self._loss_scale.variables):
            store[_LOSS_SCALE_KEY.format(index)] = variable.numpy()
        if self._last_nonfinite is not None:
            store[_FLAGS_KEY] = self._last_nonfinite.numpy()

    def load_own_variables(self, store):
        """Restores what `save_own_variables` of any release wrote, or a plain
        optimizer's store into the inner optimizer. Like Keras, an optimizer
        whose variable count matches neither (not built yet) is left
        untouched, scale included, with a warning.

        Raises:
          TypeError, ValueError: a stored loss-scale value cannot be assigned
            exactly (`LossScale.check_loadable`); nothing was assigned.
        """
        inner, keys = self.inner_optimizer, list(store.keys())
        indices = [key for key in keys if key.isdigit()]
        if len(indices) == len(keys) == len(inner.variables):  # A plain one's.
            for index, variable in enumerate(inner.variables):
                variable.assign(store[str(index)])
            # Keras loads the inner optimizer next, from its own entry, which
            # a plain optimizer's file lacks: spare it a false warning.
            def load_unless_empty(inner_store):
                if list(inner_store.keys()):
                    inner.load_own_variables(inner_store)

            private_api.keras_load_own_variables_once(inner, load_unless_empty)
            return
        indexed = self._indexed_variables()
        if len(indices) != len(indexed):
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.name}', "
                f"because it has {len(indexed)} variables whereas the saved "
                f"optimizer has {len(indices)} variables (a plain one's would "
                f"have {len(inner.variables)}). Is it built? Call optimizer."
                "build(model.trainable_variables) before loading.",
                stacklevel=3)
            return
        scale = self._loss_scale
        stored_scale = [store[key] if key in keys else None for key in (
            _LOSS_SCALE_KEY.format(i) for i in range(len(scale.variables)))]
        scale.check_loadable(stored_scale)  # Before anything is assigned.
        for index, variable in enumerate(indexed):
            variable.assign(store[str(index)])
        for variable, value in zip(scale.variables, stored_scale):
            if value is not None:
                variable.assign(value)
        flags = self._last_nonfinite
        if flags is not None and _FLAGS_KEY in keys and tuple(
                store[_FLAGS_KEY].shape) == tuple(flags.shape):
            flags.assign(store[_FLAGS_KEY])

    def _hand_pending_restores_to_inner(self):
        """Called by `build` before the inner optimizer builds: restores
        pending on the wrapper under names not its own (the inner
        optimizer's slot lists) move to the inner optimizer."""
        pending = private_api.pending_restores(self)
        for name in [name for name in pending if name not in _WRAPPER_NAMES]:
            private_api.defer_restores(self.inner_optimizer, name,
                                       pending.pop(name))

    def _checkpoint_children(self, found, save_type, **kwargs):
        """The wrapper's checkpoint dependencies from those automatic
        tracking `found`."""
        # SavedModels keep the default dependencies, as does a wrapper still
        # being constructed.
        if save_type != "checkpoint" or "inner_optimizer" not in found:
            return found
        children = private_api.trackable_children(
            self.inner_optimizer, save_type, **kwargs)
        # Re-added last, below: listed first it would be the first path to
        # the slots and move their checkpoint keys.
        children.pop(private_api.KERAS_VARIABLES, None)
        for name in _PLACEHOLDER_VALUES:
            # A learning-rate schedule is not a variable and is not saved.
            if hasattr(children.get(name), "assign"):
                children[name] = _alias(self, name, children[name])
        # The wrapper's own placeholders are not saved: their names are the
        # inner optimizer's. `_last_nonfinite` is left out: a dependency
        # older checkpoints lack would fail `assert_consumed()`.
        children.update({name: found[name] for name in _WRAPPER_NAMES})
        # One object per optimizer (cached past Keras' tracking, as `_alias`).
        children[private_api.KERAS_VARIABLES] = self.__dict__.setdefault(
            "_checkpoint_plain_variables", _PlainVariables(self))
        return children


def _alias(optimizer, name, variable):
    """The optimizer's one alias for `variable` under `name` (a checkpoint
    must see the same object each time), cached past Keras' tracking."""
    aliases = optimizer.__dict__.setdefault("_checkpoint_aliases", {})
    alias = aliases.get(name)
    if alias is None or alias.variable is not variable:
        alias = aliases[name] = _Alias(variable, _PLACEHOLDER_VALUES[name])
    return alias


class _Alias(private_api.SavedTensors):
    """One inner-optimizer variable under a plain name, keeping its own
    checkpoint key. Restoring `placeholder` (a wrapper's unused own state)
    leaves the variable alone: its value comes through `inner_optimizer/`."""

    def __init__(self, variable, placeholder):
        self.variable = variable
        self._placeholder = placeholder

    def save_tensors(self):
        return {"VARIABLE_VALUE": tf.identity(self.variable)}

    def restore_tensors(self, tensors):
        value = tf.cast(tensors["VARIABLE_VALUE"], self.variable.dtype)
        is_placeholder = tf.equal(
            value, tf.constant(self._placeholder, self.variable.dtype))
        # No read-and-write-back: restores of one checkpoint run together, and
        # the real value may be written by `inner_optimizer/` at any moment.
        def restore():
            self.variable.assign(value)
            return tf.constant(True)

        return tf.cond(is_placeholder, lambda: tf.constant(False), restore)


class _PlainVariables(private_api.RestoreReceiver):
    """The wrapper's `_variables` in checkpoints: the inner optimizer's;
    restoring, a plain optimizer's entry goes to the same index of the inner
    optimizer's list, a wrapper's is ignored."""

    def __init__(self, optimizer):
        # No cycle with the optimizer, which caches this object.
        self._optimizer = weakref.ref(optimizer)

    def children(self):
        # Iterations and learning rate by their aliases: a plain optimizer's
        # `_variables/0` is its `_iterations`.
        optimizer = self._optimizer()
        inner = optimizer.inner_optimizer
        named = private_api.trackable_children(inner)
        aliased = {id(named[name]): name
                   for name in _PLACEHOLDER_VALUES if name in named}
        return {str(index): _alias(optimizer, aliased[id(v)], v)
                if id(v) in aliased else v for index, v in enumerate(
                    private_api.keras_own_variables(inner))}

    def receive(self, name, position):
        optimizer = self._optimizer()
        saved = self.saved_child_names(position, optimizer)
        # Every wrapper has an `inner_optimizer`.
        if saved is not None and "inner_optimizer" not in saved:
            private_api.defer_restores(
                private_api.keras_own_variables(optimizer.inner_optimizer),
                name, [position])

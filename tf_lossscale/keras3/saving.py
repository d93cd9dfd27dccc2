"""How the Keras 3 `LossScaleOptimizer` saves its state, and what it restores.

`.keras` and `.weights.h5` files (`save_own_variables`): keys "0", "1", ...
hold the wrapper's own variables then the inner optimizer's, in the order
the first release wrote them; "loss_scale.<i>" the loss scale's variables;
`LATER_STATE_KEYS` the state added since (a file without it leaves it at its
initial value). A plain optimizer's store loads into the inner optimizer.

`tf.train.Checkpoint` (`checkpoint_children`): a plain Keras optimizer's
dependency names pointing at the inner optimizer's state, plus
`inner_optimizer`, `loss_scale` and `_skipped_steps`. So checkpoints of a
plain optimizer, of Keras 3's wrapper and of every earlier release restore,
before or after the optimizer is built. What loads into what, and how the
restore is routed: docs/guides/saving.md.
"""

import warnings
import weakref

import tensorflow as tf

from tf_lossscale._internal import private_api

# Wrapper state beyond the indexed keys: attribute name -> key in the store.
LATER_STATE_KEYS = {"_last_nonfinite": "last_nonfinite"}

# What wrappers' checkpoints (earlier releases', Keras 3's) hold at the top
# level for the wrapper's own, never-used `iterations` and `learning_rate`.
_PLACEHOLDER_VALUES = {private_api.KERAS_ITERATIONS: 0,
                       private_api.KERAS_LEARNING_RATE: 0.0}

_LOSS_SCALE_KEY = "loss_scale.{}"

# The wrapper's own checkpoint dependencies (and later state, should it ever
# be saved): restorations pending under these names stay with the wrapper.
_WRAPPER_NAMES = ("inner_optimizer", "loss_scale", "_skipped_steps",
                  *LATER_STATE_KEYS)


def _later_state(optimizer):
    """`[(store_key, variable)]` of the `LATER_STATE_KEYS` that exist."""
    return [(key, getattr(optimizer, name))
            for name, key in LATER_STATE_KEYS.items()
            if getattr(optimizer, name, None) is not None]


def _indexed_variables(optimizer):
    """The variables stored under "0", "1", ..., in the first release's
    order."""
    later = {id(variable) for _, variable in _later_state(optimizer)}
    own = [v for v in private_api.keras_own_variables(optimizer)
           if id(v) not in later]
    return own + list(optimizer.inner_optimizer.variables)


def listed_variables(optimizer):
    """`optimizer.variables`: own state, then the loss scale's, then inner."""
    return (list(private_api.keras_own_variables(optimizer))
            + list(optimizer.loss_scale.variables)
            + list(optimizer.inner_optimizer.variables))


def save_own_variables(optimizer, store):
    for index, variable in enumerate(_indexed_variables(optimizer)):
        store[str(index)] = variable.numpy()
    for index, variable in enumerate(optimizer.loss_scale.variables):
        store[_LOSS_SCALE_KEY.format(index)] = variable.numpy()
    for key, variable in _later_state(optimizer):
        store[key] = variable.numpy()


def _is_plain_store(optimizer, store):
    """Whether a plain optimizer like the inner one saved `store`: only
    indexed keys, as many as the inner optimizer has variables."""
    keys = list(store.keys())
    return all(key.isdigit() for key in keys) and len(keys) == len(
        optimizer.inner_optimizer.variables)


def load_own_variables(optimizer, store):
    """Restores what `save_own_variables` of any release wrote, or a plain
    optimizer's store into the inner optimizer (the scale keeps its initial
    value). Like Keras, an optimizer whose variable count matches neither
    (not built yet) is left untouched, scale included, with a warning: a
    restored scale with fresh slots would be a state no run ever had.

    Raises:
      TypeError, ValueError: a stored loss-scale value cannot be assigned
        exactly (`LossScale.check_loadable`); nothing was assigned.
    """
    inner = optimizer.inner_optimizer
    if _is_plain_store(optimizer, store):
        for index, variable in enumerate(inner.variables):
            variable.assign(store[str(index)])
        # Keras loads the inner optimizer next, from its own entry, which a
        # plain optimizer's file lacks: its warning ("Skipping variable
        # loading ... 0 variables") would call the state just loaded lost.
        def load_unless_empty(inner_store):
            if list(inner_store.keys()):
                inner.load_own_variables(inner_store)

        private_api.keras_load_own_variables_once(inner, load_unless_empty)
        return
    indexed = _indexed_variables(optimizer)
    stored_indices = [key for key in store.keys() if key.isdigit()]
    if len(stored_indices) != len(indexed):
        warnings.warn(
            f"Skipping variable loading for optimizer '{optimizer.name}', "
            f"because it has {len(indexed)} variables whereas the saved "
            f"optimizer has {len(stored_indices)} variables (a plain "
            f"optimizer's would have {len(inner.variables)}). This is likely "
            "because the optimizer has not been built yet: call "
            "optimizer.build(model.trainable_variables) before loading.",
            stacklevel=3)
        return
    loss_scale = optimizer.loss_scale
    # Older files lack the state added since.
    keys = [_LOSS_SCALE_KEY.format(index)
            for index in range(len(loss_scale.variables))]
    stored_scale = [store[key] if key in store.keys() else None
                    for key in keys]
    loss_scale.check_loadable(stored_scale)  # Before anything is assigned.
    for index, variable in enumerate(indexed):
        variable.assign(store[str(index)])
    for variable, value in zip(loss_scale.variables, stored_scale):
        if value is not None:
            variable.assign(value)
    for key, variable in _later_state(optimizer):
        if key in store.keys() and tuple(store[key].shape) == tuple(
                variable.shape):
            variable.assign(store[key])


class _Alias(private_api.SavedTensors):
    """Saves and restores one inner-optimizer variable under a plain name.

    A separate object, so the variable keeps its own checkpoint key (a
    variable is saved under the first path that reaches it). Restoring the
    `placeholder` value leaves the variable alone: that is what earlier
    releases and Keras 3 wrote for their unused own state, and the real value
    arrives through `inner_optimizer/`.
    """

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


def _alias(optimizer, name, variable):
    """The optimizer's one alias for `variable` under `name`: a checkpoint
    must see the same object each time. Cached in `__dict__`, past Keras'
    tracking, so that the cache is no dependency."""
    aliases = optimizer.__dict__.setdefault("_checkpoint_aliases", {})
    alias = aliases.get(name)
    if alias is None or alias.variable is not variable:
        alias = aliases[name] = _Alias(variable, _PLACEHOLDER_VALUES[name])
    return alias


def _plain_entries(optimizer):
    """The inner optimizer's variables as a plain optimizer lists them in
    `_variables`, its iterations and learning rate by their aliases (a plain
    optimizer's `_variables/0` is its `_iterations`)."""
    inner = optimizer.inner_optimizer
    named = private_api.trackable_children(inner)
    aliased = {id(named[name]): name
               for name in _PLACEHOLDER_VALUES if name in named}
    return [_alias(optimizer, aliased[id(v)], v) if id(v) in aliased else v
            for v in private_api.keras_own_variables(inner)]


class _PlainVariables(private_api.RestoreReceiver):
    """The wrapper's `_variables` in checkpoints.

    Saving, its entries are the inner optimizer's variables (`_plain_entries`).
    Restoring, TF hands `receive` every entry the checkpoint has under
    `_variables` that no other name matched. A plain optimizer's entry goes
    to the same index of the inner optimizer's own list, restored now if it
    exists and when Keras appends it otherwise. A wrapper's (every wrapper
    has an `inner_optimizer`) holds that wrapper's own variables: ignored,
    its inner state comes through `inner_optimizer/`.
    """

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)

    def children(self):
        optimizer = self._optimizer()
        if optimizer is None:
            return {}
        return {str(index): entry
                for index, entry in enumerate(_plain_entries(optimizer))}

    def receive(self, name, position):
        optimizer = self._optimizer()
        if optimizer is None:
            return
        saved = self.saved_child_names(position, optimizer)
        if saved is not None and "inner_optimizer" not in saved:
            private_api.defer_restores(
                private_api.keras_own_variables(optimizer.inner_optimizer),
                name, [position])


def hand_pending_restores_to_inner(optimizer):
    """Passes restorations pending on the wrapper to the inner optimizer.

    Called by `build` before the inner optimizer is built. A checkpoint
    restored earlier left its entries for the inner optimizer's slot lists
    (`_momentums`, ...) pending under those names on the wrapper, where TF
    would hand them only to a dependency the wrapper itself creates. The inner
    optimizer creates them: its own tracking restores them once they wait
    there (at once for a dependency it already has).
    """
    pending = private_api.pending_restores(optimizer)
    for name in [name for name in pending if name not in _WRAPPER_NAMES]:
        private_api.defer_restores(optimizer.inner_optimizer, name,
                                   pending.pop(name))


def checkpoint_children(optimizer, own_children, save_type, **kwargs):
    """The wrapper's checkpoint dependencies (docs/guides/saving.md).

    Args:
      optimizer: the LossScaleOptimizer.
      own_children: what automatic tracking found on the wrapper.
      save_type: as given to `private_api.trackable_children`.
      **kwargs: passed on to the inner optimizer's.
    """
    # SaveType is a str enum; SavedModels keep the default dependencies.
    # Keras asks for them while constructing, before the inner optimizer is
    # attached.
    if save_type != "checkpoint" or "inner_optimizer" not in own_children:
        return own_children
    inner = optimizer.inner_optimizer
    children = private_api.trackable_children(inner, save_type, **kwargs)
    # Re-added last, below: listed first it would be the first path to the
    # slots and move their checkpoint keys.
    children.pop(private_api.KERAS_VARIABLES, None)
    for name in _PLACEHOLDER_VALUES:
        # A learning-rate schedule is not a variable and is not saved.
        if hasattr(children.get(name), "assign"):
            children[name] = _alias(optimizer, name, children[name])
    # The wrapper's own placeholders (its unused iterations and learning
    # rate, its own copy of the variable lists) are not saved: their names
    # now belong to the inner optimizer's state.
    for name in ("inner_optimizer", "loss_scale"):
        children[name] = own_children[name]
    # Later state (LATER_STATE_KEYS) is left out: a dependency that older
    # checkpoints lack would fail their `assert_consumed()`.
    children["_skipped_steps"] = own_children["_skipped_steps"]
    # One object per optimizer (cached past Keras' tracking, as `_alias`).
    children[private_api.KERAS_VARIABLES] = optimizer.__dict__.setdefault(
        "_checkpoint_plain_variables", _PlainVariables(optimizer))
    return children

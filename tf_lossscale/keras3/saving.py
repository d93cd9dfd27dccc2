"""How a `LossScaleOptimizer`'s state is saved, and what it can be restored from.

Two formats carry optimizer state, and each must keep reading what earlier
versions wrote.

`.keras` files and `.weights.h5` (Keras' `save_own_variables` store):

* keys ``"0"``, ``"1"``, ...: the wrapper's own Keras variables as 0.1.0 had
  them (the base class's unused `iteration` and `learning_rate`, then
  `skipped_steps`), then every variable of the inner optimizer, in order;
* ``"loss_scale.<i>"``: the loss scale's variables (`LossScale.variables`);
* one named key per piece of wrapper state added since 0.1.0
  (`LATER_STATE_KEYS`: which variables overflowed on the last skipped step),
  absent from older files, which leave it at its initial value.

That is exactly 0.1.0's layout plus named keys, so every file written since
0.1.0 loads, whatever `optimizer.variables` lists. A plain optimizer's store
(only ``"0"``, ``"1"``, ...: exactly the inner optimizer's variables) loads
into the inner optimizer: `model.load_weights("plain.keras")` into a model
compiled with the wrapper and built carries the plain optimizer's state over.
The other way, a plain optimizer given a wrapper's store warns that it skips
it (Keras' own check: the counts differ); take `model.optimizer.
inner_optimizer` of the loaded wrapped model instead. A new optimizer passed
to `model.compile` after `load_model` starts afresh, as in Keras: wrap the
loaded one, `LossScaleOptimizer(model.optimizer)`, to keep its state.

`tf.train.Checkpoint`: the wrapper's checkpoint dependencies are those of a
plain Keras optimizer pointing at the inner optimizer's state: `_iterations`,
`_learning_rate`, its named slot lists such as `_momentums` and `_variables`
(listed last, so that a variable another plain name reaches keeps its key;
Adafactor's slots, which no other name reaches, are keyed `_variables/<i>`
as in a plain optimizer's checkpoint); plus `inner_optimizer`, `loss_scale`
(where tf-keras kept it) and `skipped_steps`. State added since
0.1.0 is not a checkpoint dependency, so every older checkpoint still passes
`assert_consumed()`. So, whether the restore comes before or after the
optimizer is built (Keras builds it at the first step):

* a checkpoint of a plain optimizer restores into a wrapper around the same
  optimizer class (iterations and slots carry over; the scale starts at its
  initial value);
* a wrapper's checkpoint restores into a plain optimizer (the loss-scale
  entries are simply not used: restore with `expect_partial()`);
* a checkpoint of Keras 3's wrapper restores its inner optimizer's state
  into this one (its `dynamic_scale` and `step_counter` are not read: names
  this wrapper does not save would make `assert_consumed()` fail on every
  checkpoint without them);
* 0.1.0 checkpoints, whose top-level `_iterations` and `_learning_rate` held
  the wrapper's own unused placeholders (always 0 and 0.0) next to the real
  values under `inner_optimizer/`, restore the real values:
  `_Alias` ignores those placeholders (Keras 3's wrapper writes the same
  placeholders).

Restoring before the optimizer is built is where the plain names need care.
TF keeps a checkpoint entry it cannot match yet pending on the object whose
child it is, and hands it over when that object tracks a dependency of that
name. The plain names are children of the wrapper, but the inner optimizer
creates the state behind them. So:

* `_variables` is every variable of a plain optimizer in order: the only
  name under which Adafactor's slots are saved, and the one that survives
  SGD and RMSprop replacing their momentum lists while building.
  `_PlainVariables` saves the inner optimizer's list under it and, when
  restoring, hands a plain optimizer's entries to the inner optimizer's list
  (now, or when it creates them). A wrapper checkpoint's `_variables` holds
  that wrapper's own variables (0.1.0's placeholders and `skipped_steps`,
  Keras 3's scale and counter) and is ignored: its inner state comes through
  `inner_optimizer/`.
* Entries still pending on the wrapper when it is built (the named slot
  lists, state a custom optimizer keeps outside its `variables`) are passed
  to the inner optimizer before it builds
  (`hand_pending_restores_to_inner`), whose own tracking then restores them.
"""

import warnings
import weakref

import tensorflow as tf

from tf_lossscale._internal import private_api

# Wrapper state added after 0.1.0: attribute name -> key in the .keras store.
LATER_STATE_KEYS = {"_last_nonfinite": "last_nonfinite"}

# What 0.1.0 saved at the top level of a checkpoint for the wrapper's own,
# never-used `iterations` and `learning_rate`.
_PLACEHOLDER_VALUES = {private_api.KERAS_ITERATIONS: 0,
                       private_api.KERAS_LEARNING_RATE: 0.0}

_LOSS_SCALE_KEY = "loss_scale.{}"

# The wrapper's own checkpoint dependencies (and later state, should it ever
# be saved): restorations pending under these names stay with the wrapper.
_WRAPPER_NAMES = ("inner_optimizer", "loss_scale", "_skipped_steps",
                  *LATER_STATE_KEYS)


def _later_state(optimizer):
    """`[(store_key, variable)]` of post-0.1.0 wrapper state that exists."""
    return [(key, getattr(optimizer, name))
            for name, key in LATER_STATE_KEYS.items()
            if getattr(optimizer, name, None) is not None]


def _indexed_variables(optimizer):
    """The variables stored under "0", "1", ...: 0.1.0's order."""
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
    """Whether `store` is what a plain optimizer like the inner one saved:
    only indexed keys, as many as the inner optimizer has variables (a
    wrapper's store has three more and loss-scale keys)."""
    keys = list(store.keys())
    return all(key.isdigit() for key in keys) and len(keys) == len(
        optimizer.inner_optimizer.variables)


def _expect_empty_inner_store(inner):
    """Lets the inner optimizer's next load pass an empty store silently.

    Keras loads the inner optimizer next, from its own entry under the
    wrapper's, which a plain optimizer's file does not have; its warning
    ("Skipping variable loading ... the saved optimizer has 0 variables")
    would report as lost the state just loaded. One call only: the hook
    removes itself, and a store with variables loads as usual.
    """
    def load_unless_empty(store):
        if list(store.keys()):
            inner.load_own_variables(store)

    private_api.keras_load_own_variables_once(inner, load_unless_empty)


def load_own_variables(optimizer, store):
    """Restores what `save_own_variables` (of any version) wrote, or a plain
    optimizer's store into the inner optimizer (the scale keeps its initial
    value, as with a plain checkpoint).

    Like Keras, an optimizer whose variable count matches neither layout
    (typically: not built yet) is left untouched with a warning, the loss
    scale included: a restored scale with fresh counters and slots would be
    a state no training run ever had.

    Raises:
      TypeError, ValueError: a stored loss-scale value cannot be assigned
        exactly to its variable (`LossScale.check_loadable`); nothing was
        assigned.
    """
    if _is_plain_store(optimizer, store):
        for index, variable in enumerate(optimizer.inner_optimizer.variables):
            variable.assign(store[str(index)])
        _expect_empty_inner_store(optimizer.inner_optimizer)
        return
    indexed = _indexed_variables(optimizer)
    stored_indices = [key for key in store.keys() if key.isdigit()]
    if len(stored_indices) != len(indexed):
        warnings.warn(
            f"Skipping variable loading for optimizer '{optimizer.name}', "
            f"because it has {len(indexed)} variables whereas the saved "
            f"optimizer has {len(stored_indices)} variables (a plain "
            "optimizer's would have "
            f"{len(optimizer.inner_optimizer.variables)}). This is likely "
            "because the optimizer has not been built yet: call "
            "optimizer.build(model.trainable_variables) before loading.",
            stacklevel=3)
        return
    loss_scale = optimizer.loss_scale
    keys = [_LOSS_SCALE_KEY.format(index)
            for index in range(len(loss_scale.variables))]
    # Older files lack the state added since.
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
    `placeholder` value leaves the variable alone: that is what 0.1.0 and
    Keras 3 wrote for their unused own state, and the real value arrives
    through `inner_optimizer/`.
    """

    def __init__(self, variable, placeholder):
        self.variable = variable
        self._placeholder = placeholder

    def save_tensors(self):
        return {"VARIABLE_VALUE": tf.identity(self.variable)}

    def restore_tensors(self, tensors):
        value = tf.cast(tensors["VARIABLE_VALUE"],
                        self.variable.dtype)
        is_placeholder = tf.equal(
            value, tf.constant(self._placeholder, self.variable.dtype))
        # No read-and-write-back: restores of one checkpoint run together, and
        # the real value may be written by `inner_optimizer/` at any moment.
        def restore():
            self.variable.assign(value)
            return tf.constant(True)

        return tf.cond(is_placeholder, lambda: tf.constant(False), restore)


def _alias(optimizer, name, variable):
    """The optimizer's one alias for `variable` under `name`.

    A checkpoint must see the same object each time it asks for the
    wrapper's dependencies. The cache goes straight into `__dict__`, past
    Keras' attribute tracking, so it is not itself a dependency.
    """
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
    entries = []
    for variable in private_api.keras_own_variables(inner):
        for name in _PLACEHOLDER_VALUES:
            if variable is getattr(inner, name):
                variable = _alias(optimizer, name, variable)
                break
        entries.append(variable)
    return entries


def _written_by_plain_optimizer(position, optimizer):
    """Whether the checkpoint object restored into `optimizer` is a plain
    optimizer's: every wrapper (0.1.0, Keras 3, this one) has an
    `inner_optimizer`."""
    names = private_api.saved_child_names(position, optimizer)
    return names is not None and "inner_optimizer" not in names


class _PlainVariables(private_api.RestoreReceiver):
    """The wrapper's `_variables` in checkpoints (see the module docstring).

    Saving, its entries are the inner optimizer's variables (`_plain_entries`).
    Restoring, it matches none of them by name, so TF hands every entry the
    checkpoint has under `_variables` and no other name has matched yet to
    `receive`, which decides where it goes: a plain optimizer's entry to the
    same index of the inner optimizer's own list, which restores it now if
    it exists and when Keras appends it otherwise.
    """

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)
        self._verdict = (None, False)  # (restore uid, written by plain)

    def children(self):
        optimizer = self._optimizer()
        if optimizer is None:
            return {}
        return {str(index): entry
                for index, entry in enumerate(_plain_entries(optimizer))}

    def receive(self, name, position):
        optimizer = self._optimizer()
        if optimizer is None or not self._from_plain_optimizer(
                optimizer, position):
            return
        entries = private_api.keras_own_variables(optimizer.inner_optimizer)
        private_api.defer_restores(entries, name, [position])
        if name.isdigit() and int(name) < len(entries):
            private_api.restore_deferred(entries, name, entries[int(name)])

    def _from_plain_optimizer(self, optimizer, position):
        # Decided once per restore: a large model files many entries.
        uid, verdict = self._verdict
        if uid != private_api.restore_uid(position):
            verdict = _written_by_plain_optimizer(position, optimizer)
            self._verdict = (private_api.restore_uid(position), verdict)
        return verdict


def _plain_variables(optimizer):
    """The optimizer's one `_PlainVariables`, cached like `_alias`."""
    proxy = optimizer.__dict__.get("_checkpoint_plain_variables")
    if proxy is None:
        proxy = optimizer.__dict__["_checkpoint_plain_variables"] = (
            _PlainVariables(optimizer))
    return proxy


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
    inner = optimizer.inner_optimizer
    for name in [name for name in pending if name not in _WRAPPER_NAMES]:
        private_api.defer_restores(inner, name, pending.pop(name))
        existing = private_api.dependency(inner, name)
        if existing is not None:
            private_api.restore_deferred(inner, name, existing)


def checkpoint_children(optimizer, own_children, save_type, **kwargs):
    """The wrapper's checkpoint dependencies (see the module docstring).

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
    children[private_api.KERAS_VARIABLES] = _plain_variables(optimizer)
    return children

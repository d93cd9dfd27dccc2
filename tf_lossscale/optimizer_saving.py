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
0.1.0 loads, whatever `optimizer.variables` lists.

`tf.train.Checkpoint`: the wrapper's checkpoint dependencies are those of a
plain Keras optimizer (`_iterations`, `_learning_rate` and its named slot lists
such as `_momentums`) pointing at the inner optimizer's state, plus
`inner_optimizer`, `loss_scale` (where tf-keras kept it) and `skipped_steps`.
State added since 0.1.0 is not a checkpoint dependency, so every older
checkpoint still passes `assert_consumed()`. So:

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

The plain optimizer's `_variables` list is not aliased: in wrapper
checkpoints (0.1.0's, Keras 3's) that name holds the wrapper's own variables,
and the slots are reachable through the named slot lists anyway.
"""

import warnings

import tensorflow as tf

# Wrapper state added after 0.1.0: attribute name -> key in the .keras store.
LATER_STATE_KEYS = {"_last_nonfinite": "last_nonfinite"}

# What 0.1.0 saved at the top level of a checkpoint for the wrapper's own,
# never-used `iterations` and `learning_rate`.
_PLACEHOLDER_VALUES = {"_iterations": 0, "_learning_rate": 0.0}

_LOSS_SCALE_KEY = "loss_scale.{}"


def _later_state(optimizer):
    """`[(store_key, variable)]` of post-0.1.0 wrapper state that exists."""
    return [(key, getattr(optimizer, name))
            for name, key in LATER_STATE_KEYS.items()
            if getattr(optimizer, name, None) is not None]


def _indexed_variables(optimizer):
    """The variables stored under "0", "1", ...: 0.1.0's order."""
    later = {id(variable) for _, variable in _later_state(optimizer)}
    own = [v for v in optimizer._variables if id(v) not in later]  # pylint: disable=protected-access
    return own + list(optimizer.inner_optimizer.variables)


def listed_variables(optimizer):
    """`optimizer.variables`: own state, then the loss scale's, then inner."""
    return (list(optimizer._variables)  # pylint: disable=protected-access
            + list(optimizer.loss_scale.variables)
            + list(optimizer.inner_optimizer.variables))


def save_own_variables(optimizer, store):
    for index, variable in enumerate(_indexed_variables(optimizer)):
        store[str(index)] = variable.numpy()
    for index, variable in enumerate(optimizer.loss_scale.variables):
        store[_LOSS_SCALE_KEY.format(index)] = variable.numpy()
    for key, variable in _later_state(optimizer):
        store[key] = variable.numpy()


def load_own_variables(optimizer, store):
    """Restores what `save_own_variables` (of any version) wrote.

    Like Keras, an optimizer whose variable count differs from the file's
    (typically: not built yet) is left untouched with a warning, the loss
    scale included: a restored scale with fresh counters and slots would be
    a state no training run ever had.
    """
    indexed = _indexed_variables(optimizer)
    stored_indices = [key for key in store.keys() if key.isdigit()]
    if len(stored_indices) != len(indexed):
        warnings.warn(
            f"Skipping variable loading for optimizer '{optimizer.name}', "
            f"because it has {len(indexed)} variables whereas the saved "
            f"optimizer has {len(stored_indices)} variables. This is likely "
            "because the optimizer has not been built yet: call "
            "optimizer.build(model.trainable_variables) before loading.",
            stacklevel=3)
        return
    for index, variable in enumerate(indexed):
        variable.assign(store[str(index)])
    for index, variable in enumerate(optimizer.loss_scale.variables):
        key = _LOSS_SCALE_KEY.format(index)
        if key in store.keys():
            variable.assign(store[key])
    for key, variable in _later_state(optimizer):
        if key in store.keys() and tuple(store[key].shape) == tuple(
                variable.shape):
            variable.assign(store[key])


class _Alias(tf.__internal__.tracking.Trackable):
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

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": tf.identity(self.variable)}

    def _restore_from_tensors(self, restored_tensors):
        value = tf.cast(restored_tensors["VARIABLE_VALUE"],
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


def checkpoint_children(optimizer, own_children, save_type, **kwargs):
    """The wrapper's checkpoint dependencies (see the module docstring).

    Args:
      optimizer: the LossScaleOptimizer.
      own_children: what automatic tracking found on the wrapper.
      save_type: as given to `_trackable_children`.
      **kwargs: passed on to the inner optimizer's `_trackable_children`.
    """
    # SaveType is a str enum; SavedModels keep the default dependencies.
    # Keras asks for them while constructing, before the inner optimizer is
    # attached.
    if save_type != "checkpoint" or "inner_optimizer" not in own_children:
        return own_children
    inner = optimizer.inner_optimizer
    children = dict(inner._trackable_children(save_type, **kwargs))  # pylint: disable=protected-access
    children.pop("_variables", None)
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
    return children


"""Agreement across replicas and workers under `tf.distribute`.

A NaN may appear on one replica only, so every replica on every worker must
reach the same skip decision before any branch that holds a collective. An
optimizer step gets it from the gradients' own all-reduce, moved ahead of
the decision (`sum_gradients`): a NaN or Inf on any replica is in the sum,
every replica holds the same sum, and each worker decides from its first
replica's values (`from_summed`) with no collective of its own. A loss
scale's `update`, given each replica's own gradients, sums one all-finite
flag per replica instead (`all_replicas_true`). The loss scale is updated
once, in cross-replica context (reached with `merge_call`). Parameter-server
and central-storage strategies are refused: their variables are not
mirrored, and parameter-server workers apply updates asynchronously.
"""

import tensorflow as tf

_UNSUPPORTED_STRATEGIES = (
    tf.distribute.experimental.ParameterServerStrategy,
    tf.distribute.experimental.CentralStorageStrategy,
    tf.compat.v1.distribute.experimental.ParameterServerStrategy,
    tf.compat.v1.distribute.experimental.CentralStorageStrategy,
)


def check_supported(strategy=None):
    """Raises ValueError if the (current) strategy cannot agree on a step.

    Args:
      strategy: the strategy to check; the current one when None.
    """
    strategy = strategy or tf.distribute.get_strategy()
    if isinstance(strategy, _UNSUPPORTED_STRATEGIES):
        raise ValueError(
            f"tf_lossscale does not support {type(strategy).__name__}: its "
            "variables are not mirrored per replica, so replicas cannot share "
            "one loss scale and one skip decision. Use MirroredStrategy, "
            "MultiWorkerMirroredStrategy, OneDeviceStrategy or no strategy.")


def strategy_in_use():
    """The strategy whose scope or `run` we are in; None without one."""
    return (tf.distribute.get_strategy() if tf.distribute.has_strategy()
            else None)


def check_same_strategy(owner, created_under):
    """Raises ValueError unless the current strategy is `created_under`.

    State mirrored by one strategy must be updated under that strategy: out
    of its scope there is no strategy to reduce with, and each worker of a
    MultiWorkerMirroredStrategy would silently decide alone.

    Args:
      owner: what holds the state, for the message.
      created_under: the strategy the state was created under, or None for
        plain variables (usable anywhere).
    """
    current = strategy_in_use()
    if created_under is not None and current is not created_under:
        where = (f"under {type(current).__name__}" if current is not None
                 else "outside any strategy")
        raise ValueError(
            f"{owner} was created under {type(created_under).__name__} but "
            f"used {where}; call it under that strategy's scope() or inside "
            "its run()")


def in_replica_context():
    """True inside `strategy.run` of a real (non-default) strategy."""
    return (tf.distribute.has_strategy()
            and not tf.distribute.in_cross_replica_context())


def call_in_cross_replica_context(fn, *args):
    """Returns `fn(*args)` evaluated in cross-replica context.

    From a replica context this goes through `merge_call`: replicas pause
    until all of them arrive, `fn` runs once with their arguments combined
    into per-replica values, and each replica receives its result. Anywhere
    else `fn` is simply called.
    """
    if in_replica_context():
        return tf.distribute.get_replica_context().merge_call(
            lambda _strategy, *merged: fn(*merged), args=args)
    return fn(*args)


def call_for_each_replica(fn, *args):
    """From cross-replica context, runs `fn(*args)` once in every replica.

    Per-replica values in `args` are unwrapped for each replica. Without a
    strategy, `fn` is simply called.
    """
    strategy = strategy_in_use()
    if strategy is None:
        return fn(*args)
    # Every `strategy.extended` is a tf.compat.v1.distribute.StrategyExtended.
    return strategy.extended.call_for_each_replica(fn, args=args)


def local_results(value):
    """The flat list of what `value` holds on this worker: each replica's
    component of a per-replica value, anything else as it is."""
    flat = tf.nest.flatten(value)
    strategy = strategy_in_use()
    if strategy is None:
        return flat
    return [part for item in flat
            for part in strategy.experimental_local_results(item)]


def sum_gradients(grads):
    """Replica context: `grads` summed over every replica of every worker,
    with one all-reduce (the one the optimizer would make); `None` entries
    stay None. Without a strategy, or with one replica, `grads` as given.
    """
    if not in_replica_context():
        return list(grads)
    context = tf.distribute.get_replica_context()
    present = [grad for grad in grads if grad is not None]
    if context.num_replicas_in_sync == 1 or not present:
        return list(grads)
    if tf.compat.v1.executing_eagerly_outside_functions():
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, present)
    else:  # TF1 graphs, where all_reduce's gradient function fails to build.
        summed = context.merge_call(
            lambda strategy, values: strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, [(v, v) for v in values]),
            args=(present,))
    summed = iter(summed)
    return [None if grad is None else next(summed) for grad in grads]


def from_summed(fn, *args):
    """Cross-replica context: `fn(*args)` on this worker's first replica's
    values, for `args` every replica holds alike (gradients summed with
    `sum_gradients`): any replica's result is every replica's, on every
    worker, so no collective is needed. Without a strategy, `fn(*args)`."""
    strategy = strategy_in_use()
    if strategy is None:
        return fn(*args)
    first = lambda value: (  # pylint: disable=unnecessary-lambda-assignment
        strategy.experimental_local_results(value)[0]
        if isinstance(value, tf.distribute.DistributedValues) else value)
    return fn(*tf.nest.map_structure(first, args))


def _replica_sum(strategy, flags_fn, args):
    """Each replica's `flags_fn(*args)`, as float32, summed over all replicas
    and workers with one all-reduce."""
    per_replica = strategy.extended.call_for_each_replica(
        lambda *a: tf.cast(flags_fn(*a), tf.float32), args=args)
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


def all_replicas_true(flag_fn, *args):
    """Returns a scalar bool tensor: True iff `flag_fn(*args)` is True on
    every replica of every worker.

    Must be called in cross-replica context (or without a strategy). Each
    replica evaluates `flag_fn` (which returns a scalar bool tensor) on its
    own values of `args`; the flags are combined with one all-reduce of one
    float32 scalar.
    """
    strategy = strategy_in_use()
    if strategy is None:
        return flag_fn(*args)
    return tf.equal(_replica_sum(strategy, flag_fn, args),
                    tf.constant(strategy.num_replicas_in_sync, tf.float32))


def each_all_replicas_true(flags_fn, *args):
    """Returns a bool vector: element i is True iff element i of
    `flags_fn(*args)` (a bool vector of static length) is True on every
    replica of every worker.

    Must be called in cross-replica context (or without a strategy); costs
    one all-reduce of a float32 vector of that length: several flags agreed
    on for the price of one.
    """
    strategy = strategy_in_use()
    if strategy is None:
        return flags_fn(*args)
    return tf.equal(_replica_sum(strategy, flags_fn, args),
                    tf.constant(strategy.num_replicas_in_sync, tf.float32))


def any_replica_true(flags_fn, *args):
    """Returns a bool tensor: element i is True iff element i of
    `flags_fn(*args)` (a bool vector of static length) is True on any replica
    of any worker.

    Must be called in cross-replica context (or without a strategy); costs
    one all-reduce of a float32 vector of that length.
    """
    strategy = strategy_in_use()
    if strategy is None:
        return flags_fn(*args)
    return _replica_sum(strategy, flags_fn, args) > 0

"""Agreement across replicas and workers under `tf.distribute`.

Every replica on every worker must reach the same skip decision before any
branch that holds a collective; how the step gets it with no collective of
its own: docs/guides/distribution.md, "How the replicas agree".
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
    """Raises ValueError unless the current strategy is `created_under` (the
    strategy `owner`'s state was created under; None: usable anywhere).
    Elsewhere there is no strategy to reduce with, and each worker of a
    MultiWorkerMirroredStrategy would silently decide alone."""
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
    """`fn(*args)` in cross-replica context: from a replica context through
    `merge_call` (`fn` runs once, on the replicas' arguments combined into
    per-replica values, and each replica gets its result); else a call."""
    if in_replica_context():
        return tf.distribute.get_replica_context().merge_call(
            lambda _strategy, *merged: fn(*merged), args=args)
    return fn(*args)


def call_for_each_replica(fn, *args):
    """From cross-replica context, `fn(*args)` once in every replica, on its
    values of per-replica `args`; without a strategy, a call."""
    strategy = strategy_in_use()
    if strategy is None:
        return fn(*args)
    # Every `strategy.extended` is a tf.compat.v1.distribute.StrategyExtended.
    return strategy.extended.call_for_each_replica(fn, args=args)


def local_results(value):
    """The flat list of what `value` holds on this worker: each replica's
    component of a per-replica value, anything else as it is."""
    local = tf.distribute.get_strategy().experimental_local_results
    return [part for item in tf.nest.flatten(value) for part in local(item)]


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
    worker, so no collective is needed."""
    local = tf.distribute.get_strategy().experimental_local_results
    return fn(*tf.nest.map_structure(lambda value: local(value)[0], args))


def _replica_sum(flags_fn, args):
    """Each replica's `flags_fn(*args)`, as float32, summed over all replicas
    and workers with one all-reduce; `(sum, replicas)`."""
    strategy = strategy_in_use()
    per_replica = strategy.extended.call_for_each_replica(
        lambda *a: tf.cast(flags_fn(*a), tf.float32), args=args)
    return (strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica,
                            axis=None), strategy.num_replicas_in_sync)


def all_replicas_true(flags_fn, *args):
    """Cross-replica context (or no strategy): True where `flags_fn(*args)`,
    a bool scalar or vector of static length, is True on every replica of
    every worker; one all-reduce of that many float32 values."""
    if strategy_in_use() is None:
        return flags_fn(*args)
    total, count = _replica_sum(flags_fn, args)
    return tf.equal(total, tf.constant(count, tf.float32))


def any_replica_true(flags_fn, *args):
    """As `all_replicas_true`, but True where it is True on any replica."""
    if strategy_in_use() is None:
        return flags_fn(*args)
    return _replica_sum(flags_fn, args)[0] > 0

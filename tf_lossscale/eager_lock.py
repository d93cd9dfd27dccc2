"""`EagerLock`: one thread at a time through a state update run eagerly.

Eagerly, a loss scale's update is a series of separate ops (read the state,
compute the next one, assign it), and TensorFlow releases the GIL inside
each: two threads updating one `DynamicLossScale` at once would both read
the same state and one update would be lost (TensorFlow's own class loses
them). Holding a lock around the whole update makes each one atomic, so N
threads doing M updates each leave the state of N*M updates in a row.

The lock is taken only when executing eagerly. While a graph is built
(`tf.function`, a TF1 graph, XLA) there is nothing to guard, as the code runs
once, at trace time; what the graph does when it runs is not serialised by
it (see the `DynamicLossScale` docstring). An uncontended lock costs well
under a microsecond, against hundreds of microseconds for the eager update
(`benchmarks/hostile_input_costs.py` measures both).

A copy (`copy.copy`, `copy.deepcopy`, pickling) gets a new, unlocked lock:
the copy's state is its own.
"""

import contextlib
import functools
import threading

import tensorflow as tf


class EagerLock:
    """A lock that `held()` takes only when executing eagerly."""

    def __init__(self):
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def held(self):
        """Holds the lock for the block if executing eagerly; otherwise
        (building a graph) does nothing."""
        if not tf.executing_eagerly():
            yield
            return
        with self._lock:
            yield

    def __reduce__(self):
        # A lock cannot be copied or pickled; a copy gets a fresh one.
        return (EagerLock, ())


def one_thread_at_a_time(method):
    """Decorates a method of a class whose instances keep an `EagerLock` in
    `_eager_lock`: eagerly, one thread at a time runs it on an instance."""

    @functools.wraps(method)
    def serialised(self, *args, **kwargs):
        with self._eager_lock.held():  # pylint: disable=protected-access
            return method(self, *args, **kwargs)

    return serialised

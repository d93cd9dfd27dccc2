"""One thread at a time through a state update run eagerly.

Eagerly, a loss scale's update is a series of separate ops (read the state,
compute the next one, assign it), and TensorFlow releases the GIL inside
each: two threads updating one `DynamicLossScale` at once would both read
the same state and one update would be lost (TensorFlow's own class loses
them). Holding a lock around the whole update makes each one atomic, so N
threads doing M updates each leave the state of N*M updates in a row.

`one_thread_at_a_time` takes the instance's `EagerLock` only when executing
eagerly. While a graph is built (`tf.function`, a TF1 graph, XLA) there is
nothing to guard, as the code runs once, at trace time; what the graph does
when it runs is not serialised by it (see the `DynamicLossScale` docstring).
Taking an uncontended lock costs about a microsecond, against a millisecond
or more for the eager update (`benchmarks/loss_scale_benchmark.py
--only=checks` measures both).

A copy (`copy.copy`, `copy.deepcopy`, pickling) gets a new, unlocked lock:
the copy's state is its own.
"""

import functools
import threading

import tensorflow as tf


class EagerLock:
    """A `threading.Lock` (a context manager) that copies as a new one."""

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc_info):
        self._lock.release()
        return False

    def __reduce__(self):
        # A lock cannot be copied or pickled; a copy gets a fresh one.
        return (EagerLock, ())


def one_thread_at_a_time(method):
    """Decorates a method of a class whose instances keep an `EagerLock` in
    `_eager_lock`: eagerly, one thread at a time runs it on an instance;
    while a graph is built, the method runs without the lock."""

    @functools.wraps(method)
    def serialised(self, *args, **kwargs):
        if not tf.executing_eagerly():
            return method(self, *args, **kwargs)
        with self._eager_lock:  # pylint: disable=protected-access
            return method(self, *args, **kwargs)

    return serialised

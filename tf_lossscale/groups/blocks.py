"""`group.iteration()` blocks: a group's steps deferred to one agreement.

A block is open in one graph being built (shared by the replicas' threads and
their merge calls), or eagerly. The optimizers' steps inside it are deferred
(`defer`); at its end, once, in cross-replica context, they run together
(their class's `run_together`, in `step/`) as one iteration of the group.
"""

import threading

import tensorflow as tf

from tf_lossscale.ops import replicas


def _block_key():
    """Where a block is open: the graph being built, or eagerly."""
    return "eagerly" if tf.executing_eagerly() else (
        tf.compat.v1.get_default_graph())


class _OpenBlock:
    """A block while open: the steps deferred to its end, and the threads
    (replicas) inside it."""

    def __init__(self):
        self.steps = []
        self.threads = set()


class IterationBlocks:
    """Mixin of `LossScaleGroup`: its `iteration()` blocks. The group sets
    `_lock` (a `threading.RLock`) and `_blocks` (a dict)."""

    def iteration(self):
        """A context manager: the members' steps inside it are one iteration.

        Optimizer steps inside the block are deferred to its end, where the
        finiteness of all of them is decided at once (read off each step's
        gradients summed over the replicas), each applies or skips as
        `skip` says, and the loss scale takes its one step of the
        iteration. So inside the block no optimizer has applied yet:
        compute every gradient first (the losses of later steps see the
        weights as they were). A member may step once per block; optimizers
        of the group that do not step in it take no part in that iteration.
        Use it for `skip="together"` and for schedules where the optimizers
        do not all step every iteration (a critic stepping five times per
        generator step: a block each).

        Open it where the steps are built: inside the `tf.function` or the
        `train_step` (in each replica, with a strategy), not around a call
        of a compiled function. Not for TF1 graphs.

        Raises (when the block ends, or as a step is deferred):
          ValueError: no optimizer of the group stepped inside the block,
            one stepped twice, the block is nested in another of the
            group's, or `loss_scale.update` was called inside it.
        """
        return _Iteration(self)

    def deferring_block(self):
        """The open block of the current graph (or eagerly), or None."""
        with self._lock:
            return self._blocks.get(_block_key())

    def defer(self, block, member, step):
        """Defers `step` (a step of `member`'s optimizer, whose class has
        `run_together(group, steps)`) to the end of `block`."""
        if any(s.member is member for s in block.steps):
            raise ValueError(
                f"{member.name} stepped twice inside one group.iteration() "
                "block: each optimizer steps once per iteration (one block "
                "per step)")
        block.steps.append(step)

    def _open_block(self):
        with self._lock:
            block = self._blocks.setdefault(_block_key(), _OpenBlock())
            thread = threading.get_ident()
            if thread in block.threads:
                raise ValueError("group.iteration() blocks of one group "
                                 "cannot be nested")
            block.threads.add(thread)

    def _close_block(self):
        with self._lock:
            block = self._blocks.pop(_block_key(), None)
        return [] if block is None else block.steps

    def _end_block(self):
        """Cross-replica context, once per block: runs its steps."""
        steps = self._close_block()
        if not steps:
            raise ValueError(
                "No optimizer of this LossScaleGroup stepped inside group."
                "iteration(): open the block where the optimizers' "
                "apply_gradients are called (inside the tf.function or "
                "train_step that calls them)")
        return type(steps[0]).run_together(self, steps)


class _Iteration:
    """`group.iteration()`: entered in each replica; ended once, in
    cross-replica context, where the deferred steps run."""

    def __init__(self, group):
        self._group = group

    def __enter__(self):
        if not tf.compat.v1.executing_eagerly_outside_functions():
            raise ValueError("group.iteration() is for TensorFlow 2 code "
                             "(eager or tf.function), not TF1 graphs")
        self._group._open_block()  # pylint: disable=protected-access
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        group = self._group
        if exc_type is not None:
            group._close_block()  # pylint: disable=protected-access
        else:
            replicas.call_in_cross_replica_context(
                group._end_block)  # pylint: disable=protected-access
        return False

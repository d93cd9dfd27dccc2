"""`LossScaleGroup`: one loss scale for several optimizers, one step of it per
training iteration.

An optimizer joins a group by taking it as its `loss_scale`, and holds a
`GroupMember`: a `LossScale` whose `update` is that optimizer's step. The
open iteration is two int64 variables: the members that have stepped in it
(bit i for member i) and whether any of them had non-finite gradients. A step
of members M, each with its finiteness flag f (agreed by every replica):

* it is refused, changing nothing, if a member of M has stepped already in
  the open iteration (the scale would count it twice) or the state cannot be
  right (loaded damaged): eagerly `InvalidArgumentError`, in graphs an
  assertion, under XLA the loss scale's record (`xla_record.REFUSED`);
* stepped |= M; overflowed |= not all(f);
* the iteration ends when every member has stepped, or at the end of a
  `group.iteration()` block: the loss scale takes one step, finite iff no
  gradient of the iteration overflowed, and both variables go back to 0;
* a member applies iff its own gradients are finite (`skip="each"`), or iff
  every gradient of the iteration is (`skip="together"`, whose members step
  inside `group.iteration()`, at its end).

A fixed loss scale never moves: its group keeps no iteration state, and a
member skips as the fixed scale says (never, or with `skip_non_finite`).
The why and the how to use it: docs/guides/several-optimizers.md.
"""

import threading
import weakref
from typing import NamedTuple

import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale._internal import private_api
from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.loss_scales import failure_policy
from tf_lossscale.loss_scales import loss_scale as loss_scale_lib
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.ops import replicas

SKIP_RULES = ("each", "together")
# Members are bits of an int64; the sign bit stays clear.
MAX_MEMBERS = 62
# The names of the iteration's state in checkpoints and `.keras` files.
STEPPED, OVERFLOWED = "iteration_members_stepped", "iteration_overflowed"
# What a refused step was refused for (the record's first value under XLA).
_REPEATED, _INVALID = 0, 1
_UNSET = object()


class IterationStep(NamedTuple):
    """What a step of some members does to the open iteration (tensors)."""
    refused: tf.Tensor  # bool: a member stepped twice, or the state is bad.
    repeated: tf.Tensor  # bool: a member of this step stepped already.
    ends: tf.Tensor  # bool: the iteration ends with this step.
    finite: tf.Tensor  # bool: no gradient of the iteration overflowed.
    stepped: tf.Tensor  # int64: the next `stepped`.
    overflowed: tf.Tensor  # int64: the next `overflowed`.


def next_iteration(stepped, overflowed, bits, all_finite, members, ends_now):
    """One step of the members `bits` on the iteration (a pure function).

    Args:
      stepped, overflowed: the open iteration (int64 scalar tensors).
      bits: int, the bits of the members stepping now.
      all_finite: scalar bool tensor, their gradients' agreed flag.
      members: int, the bits of every member.
      ends_now: bool, whether the iteration ends with this step whatever
        has stepped (the end of a `group.iteration()` block).
    """
    bits = tf.constant(bits, tf.int64)
    members = tf.constant(members, tf.int64)
    valid = tf.logical_and(
        tf.logical_and(stepped >= 0, tf.equal(
            tf.bitwise.bitwise_and(stepped, tf.bitwise.invert(members)), 0)),
        tf.logical_or(tf.equal(overflowed, 0), tf.equal(overflowed, 1)))
    repeated = tf.not_equal(tf.bitwise.bitwise_and(stepped, bits), 0)
    now_stepped = tf.bitwise.bitwise_or(stepped, bits)
    now_overflowed = tf.logical_or(tf.equal(overflowed, 1),
                                   tf.logical_not(all_finite))
    ends = tf.logical_or(tf.constant(ends_now), tf.equal(now_stepped, members))
    zero = tf.zeros([], tf.int64)
    return IterationStep(
        refused=tf.logical_or(repeated, tf.logical_not(valid)),
        repeated=repeated, ends=ends,
        finite=tf.logical_not(now_overflowed),
        stepped=tf.where(ends, zero, now_stepped),
        overflowed=tf.where(ends, zero, tf.cast(now_overflowed, tf.int64)))


def group_of(loss_scale):
    """The `LossScaleGroup` `loss_scale` is the loss scale of, or None."""
    group = loss_scale_lib.GROUPED.get(loss_scale)
    return None if group is None else group()


def underlying(loss_scale):
    """The loss scale itself: a member's group's, or `loss_scale`."""
    if isinstance(loss_scale, GroupMember):
        return loss_scale.group.loss_scale
    return loss_scale


def _resolve(loss_scale):
    """The group's loss scale from its argument: "dynamic", a number, or a
    built-in `LossScale` (a config: `tf_lossscale.get(config)` first)."""
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return dynamic_loss_scale.DynamicLossScale()
    if isinstance(loss_scale, (int, float)) and not isinstance(
            loss_scale, bool):
        return loss_scale_lib.FixedLossScale(loss_scale)
    if isinstance(loss_scale, GroupMember):
        raise TypeError(
            "loss_scale is a member of a LossScaleGroup already "
            f"({checks.summary(loss_scale)}); share that group instead")
    if not isinstance(loss_scale, (dynamic_loss_scale.DynamicLossScale,
                                   loss_scale_lib.FixedLossScale)):
        raise TypeError(
            "loss_scale must be 'dynamic', a number, a "
            "tf_lossscale.DynamicLossScale or a FixedLossScale, got "
            f"{checks.summary(loss_scale)} of type "
            f"{type(loss_scale).__name__}")
    return loss_scale


def _block_key():
    """Where a `group.iteration()` block is open: the graph being built
    (shared by the replicas' threads and their merge calls), or eagerly."""
    return "eagerly" if tf.executing_eagerly() else (
        tf.compat.v1.get_default_graph())


class _OpenBlock:
    """A `group.iteration()` block while open in one graph (or eagerly):
    the steps deferred to its end, and the threads (replicas) inside it."""

    def __init__(self):
        self.steps = []
        self.threads = set()


class LossScaleGroup(private_api.Trackable):
    """One loss scale for several optimizers: one step of it per iteration.

    Give the group as the `loss_scale` of each optimizer wrapper (Keras 3,
    tf-keras or TF1); each optimizer then counts its own skipped steps, and
    the scale moves once per training iteration: it backs off if any
    optimizer's gradients overflowed, else counts one good step. An
    iteration ends when every optimizer of the group has stepped once (a
    GAN's `train_step` needs no extra line), or at the end of a
    `with group.iteration():` block, whose steps are applied there, after
    one agreement for all of them::

        group = tf_lossscale.LossScaleGroup(
            tf_lossscale.DynamicLossScale(2.0**15, 2000))
        d_optimizer = tf_lossscale.LossScaleOptimizer(
            keras.optimizers.Adam(2e-4), loss_scale=group)
        g_optimizer = tf_lossscale.LossScaleOptimizer(
            keras.optimizers.Adam(2e-4), loss_scale=group)

    Create the group, then its optimizers, under the strategy's scope if
    there is one; every optimizer must join before the first step.

    Args:
      loss_scale: "dynamic" (the default), a number (a fixed scale), a
        `DynamicLossScale` or a `FixedLossScale` that belongs to no group and
        no optimizer.
      skip: keyword-only. "each" (the default): an optimizer whose gradients
        are not all finite skips its step, the others apply theirs, as
        PyTorch's GradScaler does. "together": all-or-nothing, no optimizer
        applies if any overflowed; their steps must then be inside a
        `group.iteration()` block (which applies them at its end).

    Raises:
      TypeError: `loss_scale` is not one of the above, or `skip` is not a
        string.
      ValueError: `skip` is neither "each" nor "together", `loss_scale` is
        in a group already or was made under another strategy, or the
        current strategy is one loss scaling cannot support.
    """

    def __init__(self, loss_scale="dynamic", *, skip="each"):
        self._skip = checks.one_of("skip", skip, SKIP_RULES)
        inner = _resolve(loss_scale)
        if group_of(inner) is not None:
            raise ValueError(
                f"loss_scale {inner!r} is the loss scale of another "
                "LossScaleGroup already; a loss scale can be in one group")
        held_by = [getattr(o, "name", o) for o in loss_scale_lib.holders(inner)]
        if held_by and inner.variables:
            raise ValueError(
                f"loss_scale {inner!r} is held by the optimizer(s) "
                f"{', '.join(map(repr, held_by))}, whose steps would move it "
                "outside the group: give the group a loss scale no optimizer "
                "holds, and the group to every optimizer")
        replicas.check_supported()
        strategy = replicas.strategy_in_use()
        made_under = getattr(inner, "_strategy", None)
        if made_under is not None and made_under is not strategy:
            raise ValueError(
                f"loss_scale was made under {type(made_under).__name__}, the "
                "LossScaleGroup "
                + (f"under {type(strategy).__name__}" if strategy is not None
                   else "outside any strategy")
                + ": make both under the same strategy's scope()")
        self._loss_scale = inner
        self._strategy = strategy
        self._member_strategy = _UNSET
        self._members = []  # Weak references, in joining order.
        self._members_mask = None  # Fixed at the first step.
        self._blocks = {}
        self._lock = threading.RLock()
        private_api.track(self, inner, "loss_scale")
        self._state_variables = {}
        if isinstance(inner, dynamic_loss_scale.DynamicLossScale):
            for name in (STEPPED, OVERFLOWED):
                variable = loss_scale_lib.state_variable(name, 0, tf.int64)
                self._state_variables[name] = variable
                private_api.track(self, variable, name)
            # Its record under XLA names the refusals of this group.
            inner._xla_record.refusal_message = self._refusal_message  # pylint: disable=protected-access
        # Weakly both ways: the group holds the scale.
        loss_scale_lib.GROUPED[inner] = weakref.ref(self)

    @property
    def loss_scale(self):
        """The `LossScale` the group's optimizers share."""
        return self._loss_scale

    @property
    def skip(self):
        """"each" or "together", as given."""
        return self._skip

    @property
    def variables(self):
        """The state of the open iteration (empty for a fixed loss scale)."""
        return tuple(self._state_variables.values())

    @property
    def members(self):
        """The `GroupMember` of each optimizer that joined, in joining order."""
        return [member for member in (ref() for ref in self._members)
                if member is not None]

    def __call__(self):
        """The current loss scale, a scalar float32 tensor."""
        return self._loss_scale()

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

    def get_config(self):
        """`{"loss_scale": <serialized loss scale>, "skip": ...}`; the
        serialized group (`tf_lossscale.serialize`) has class name
        "LossScaleGroup" and loads with `tf_lossscale.deserialize`. A config
        holds no members: each optimizer made from one gets a group of its
        own."""
        # The form of `tf_lossscale.serialize`, for a built-in loss scale.
        inner = {"class_name": type(self._loss_scale).__name__,
                 "config": self._loss_scale.get_config()}
        return {"loss_scale": inner, "skip": self._skip}

    def __repr__(self):
        return (f"LossScaleGroup({self._loss_scale!r}, skip={self._skip!r}, "
                f"members={[m.name for m in self.members]!r})")

    # Joining.

    def check_joinable(self):
        """Raises ValueError, changing nothing, unless an optimizer made now
        (under the current strategy) can join."""
        if self._members_mask is not None:
            names = ", ".join(m.name for m in self.members) or (
                "none left (was each one discarded after its step was built?)")
            raise ValueError(
                "This LossScaleGroup has stepped already, with the optimizers "
                f"{names}: every optimizer must join before the first step "
                "(make them all, then train)")
        if len(self._members) >= MAX_MEMBERS:
            raise ValueError(f"A LossScaleGroup takes at most {MAX_MEMBERS} "
                             "optimizers")
        current = replicas.strategy_in_use()
        expected = (self._strategy if self._strategy is not None
                    else self._member_strategy)
        if expected is not _UNSET and current is not expected:
            def where(strategy):
                return ("outside any strategy" if strategy is None
                        else f"under {type(strategy).__name__} "
                        f"{id(strategy):#x}")
            which = "was made" if self._strategy is not None else (
                "has optimizers made")
            raise ValueError(
                f"This LossScaleGroup {which} {where(expected)}, but an "
                f"optimizer joins it {where(current)}: a group's optimizers "
                "live under one strategy (make the group and every optimizer "
                "under the same strategy's scope())")

    def join(self, owner=None):
        """Returns a new `GroupMember` for `owner` (an optimizer wrapper,
        held weakly, which names it in messages). Wrappers call it when
        given the group; call it yourself for your own loop's loss scale."""
        self.check_joinable()
        if self._strategy is None and self._member_strategy is _UNSET:
            self._member_strategy = replicas.strategy_in_use()
        member = GroupMember(self, len(self._members), owner)
        self._members.append(weakref.ref(member))
        return member

    def _members_bits(self):
        """The bits of the members, fixed at the first step (members whose
        optimizer is gone by then do not count)."""
        if self._members_mask is None:
            self._members_mask = sum(1 << m.index for m in self.members)
        return self._members_mask

    # Blocks.

    def _open_block(self):
        with self._lock:
            block = self._blocks.setdefault(_block_key(), _OpenBlock())
            thread = threading.get_ident()
            if thread in block.threads:
                raise ValueError("group.iteration() blocks of one group "
                                 "cannot be nested")
            block.threads.add(thread)

    def _discard_block(self):
        with self._lock:
            self._blocks.pop(_block_key(), None)

    def _end_block(self):
        """Cross-replica context, once per block: runs its steps."""
        with self._lock:
            block = self._blocks.pop(_block_key(), None)
        steps = [] if block is None else block.steps
        if not steps:
            raise ValueError(
                "No optimizer of this LossScaleGroup stepped inside group."
                "iteration(): open the block where the optimizers' "
                "apply_gradients are called (inside the tf.function or "
                "train_step that calls them)")
        # The deferred steps' own code (step/) runs them as one.
        return type(steps[0]).run_together(self, steps)

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

    # Steps (cross-replica context).

    def step(self, members, flags, *, ends_now=False, gated=True):
        """The step of `members` (a list of `GroupMember`) whose gradients'
        agreed flags are `flags`; returns `(update_op, should_apply)`, one
        `should_apply` per member, as `LossScale.update` does. Outside a
        block only one member steps at a time."""
        if self._skip == "together" and not ends_now:
            raise ValueError(
                "LossScaleGroup(skip='together') applies every optimizer's "
                "step or none, so it needs all of them before applying any: "
                "make their steps inside `with group.iteration():`")
        replicas.check_same_strategy("This LossScaleGroup", self._strategy)
        flags = [tf.convert_to_tensor(flag) for flag in flags]
        all_finite = tf.reduce_all(tf.stack(flags))
        inner = self._loss_scale
        if not self._state_variables:  # A fixed loss scale never moves.
            if not inner._needs_finiteness:  # pylint: disable=protected-access
                return loss_scale_lib.graph_op(tf.no_op()), [True] * len(flags)
            return (loss_scale_lib.graph_op(tf.no_op()),
                    self._should_apply(flags, all_finite))
        bits = sum(1 << member.index for member in members)
        stepped, overflowed = (tf.convert_to_tensor(v)
                               for v in self._state_variables.values())
        moved = next_iteration(stepped, overflowed, bits, all_finite,
                               self._members_bits(), ends_now)
        if tf.executing_eagerly():
            return self._eager_step(members, moved, stepped, overflowed,
                                    flags, gated)
        if xla_record.in_xla_context():
            return self._xla_step(members, moved, stepped, overflowed, flags)
        refusal = tf.debugging.Assert(tf.logical_not(moved.refused), [
            self._graph_message(members, moved.repeated, stepped,
                                overflowed)])
        with tf.control_dependencies([refusal]):
            assignments = self._assign(moved.stepped, moved.overflowed)
            scale_moved = tf.cond(
                moved.ends, lambda: self._move_scale(moved.finite, gated),
                lambda: tf.constant(True))
        update_op = tf.group(assignments + [scale_moved])
        with tf.control_dependencies([update_op]):
            should_apply = [tf.identity(s) for s in
                            self._should_apply(flags, moved.finite)]
        return update_op, should_apply

    def _should_apply(self, flags, iteration_finite):
        if self._skip == "each":
            return list(flags)
        return [iteration_finite] * len(flags)

    def _assign(self, stepped, overflowed):
        return [variable.assign(value, read_value=False) for variable, value
                in zip(self._state_variables.values(), (stepped, overflowed))]

    def _move_scale(self, finite, gated):
        """The loss scale's step of the iteration; in graphs, True once done
        (after its state check, assignments and failure policy)."""
        update_op, _ = self._loss_scale._step(finite, gated)  # pylint: disable=protected-access
        if update_op is None:
            return None
        with tf.control_dependencies([update_op]):
            return tf.constant(True)

    def _eager_step(self, members, moved, stepped, overflowed, flags, gated):
        with self._lock, self._loss_scale._eager_lock:  # pylint: disable=protected-access
            if bool(moved.refused):
                raise tf.errors.InvalidArgumentError(None, None, self._message(
                    members, bool(moved.repeated), int(stepped),
                    int(overflowed)))
            self._assign(moved.stepped, moved.overflowed)
            if bool(moved.ends):
                self._move_scale(moved.finite, gated)
        return None, self._should_apply(flags, moved.finite)

    def _xla_step(self, members, moved, stepped, overflowed, flags):
        """Under XLA nothing can fail: a refusal is recorded in the loss
        scale's record, which halts later steps until the host raises it
        (`xla_checks`)."""
        record = self._loss_scale._xla_record  # pylint: disable=protected-access
        record.check_watched()
        kind = tf.where(moved.repeated, tf.constant(_REPEATED, tf.int64),
                        tf.constant(_INVALID, tf.int64))
        bits = sum(1 << member.index for member in members)
        refused, proceed = record.refuse(
            moved.refused, [kind, tf.constant(bits, tf.int64), stepped,
                            overflowed])
        with tf.control_dependencies([refused]):
            assignments = self._assign(
                tf.where(proceed, moved.stepped, stepped),
                tf.where(proceed, moved.overflowed, overflowed))
            scale_moved = tf.cond(
                tf.logical_and(proceed, moved.ends),
                lambda: self._move_scale(moved.finite, True),
                lambda: tf.constant(True))
        update_op = tf.group(assignments + [refused, scale_moved])
        with tf.control_dependencies([update_op]):
            going_on = tf.logical_not(record.halted())
            should_apply = [tf.logical_and(s, going_on) for s in
                            self._should_apply(flags, moved.finite)]
        return update_op, should_apply

    # Messages.

    def _templates(self, members):
        """The messages of a refused step of `members`, with `{}` for the
        values (`tf.strings.format`): (repeated: stepped; damaged state:
        stepped, overflowed)."""
        names = ", ".join(m.name for m in members)
        bits = ", ".join(f"{m.name} (bit {1 << m.index})"
                         for m in self.members)
        repeated = (
            f"tf_lossscale: {names} stepped twice in one iteration of its "
            f"LossScaleGroup, whose optimizers are {bits}; the bits of those "
            "that stepped in this iteration: {}. An iteration ends when every "
            "optimizer has stepped once: is one of them never used, or used "
            "in other iterations only? For schedules where the optimizers do "
            "not all step every iteration, make each iteration's steps inside "
            "`with group.iteration():`. The step was refused; nothing was "
            "changed.")
        invalid = (
            f"tf_lossscale: the LossScaleGroup of {names} holds a state that "
            f"cannot be right (restored from a file, or assigned?): "
            f"{STEPPED}={{}} (its optimizers: {bits}), {OVERFLOWED}={{}} "
            "(0 or 1). The step was refused; nothing was changed.")
        return repeated, invalid

    def _message(self, members, repeated, stepped, overflowed):
        """The message of a refused step, formatted on the host as the
        step formats it."""
        templates = self._templates(members)
        if repeated:
            return failure_policy.format_like_the_step(
                templates[0], ((stepped, tf.int64),))
        return failure_policy.format_like_the_step(
            templates[1], ((stepped, tf.int64), (overflowed, tf.int64)))

    def _graph_message(self, members, repeated, stepped, overflowed):
        repeated_template, invalid_template = self._templates(members)
        return tf.where(
            repeated, tf.strings.format(repeated_template, [stepped]),
            tf.strings.format(invalid_template, [stepped, overflowed]))

    def _refusal_message(self, values):
        """The message of a refusal recorded under XLA (`xla_record.refuse`)."""
        kind, bits, stepped, overflowed = values
        members = [m for m in self.members if bits & (1 << m.index)]
        return self._message(members, kind == _REPEATED, stepped, overflowed)


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
            group._discard_block()  # pylint: disable=protected-access
            return False
        replicas.call_in_cross_replica_context(group._end_block)  # pylint: disable=protected-access
        return False


class GroupMember(loss_scale_lib.LossScale):
    """One optimizer's share of a `LossScaleGroup`: the `loss_scale` of an
    optimizer wrapper given the group.

    Reads as the group's current scale; `update(grads)` is this member's
    step: it returns `(update_op, should_apply)` for its own gradients, and
    the scale moves when the iteration ends. Its `variables`, and its
    checkpoint dependencies, are the loss scale's (under their own names,
    as a plain loss scale's) and then the group's iteration state: an
    optimizer's checkpoint or file holds the shared state. Made by
    `LossScaleGroup.join`.
    """

    def __init__(self, group, index, owner=None):
        super().__init__()
        self._group = group
        self._index = index
        self._owner = None if owner is None else weakref.ref(owner)
        inner = group.loss_scale
        names = getattr(inner, "_state_variables", {})
        for name, variable in [*names.items(),
                               *group._state_variables.items()]:  # pylint: disable=protected-access
            self._state_variables[name] = variable
            private_api.track(self, variable, name)

    @property
    def group(self):
        """The `LossScaleGroup`."""
        return self._group

    @property
    def index(self):
        """The member's place in the group (its bit), from 0."""
        return self._index

    @property
    def optimizer(self):
        """The optimizer that joined with it (None if gone or none)."""
        return None if self._owner is None else self._owner()

    def adopt(self, owner):
        """Makes `owner` (held weakly) the optimizer of a member joined
        without one."""
        if self.optimizer is None:
            self._owner = weakref.ref(owner)

    @property
    def name(self):
        """The optimizer's name, for messages."""
        owner = self.optimizer
        name = getattr(owner, "name", None)
        if not isinstance(name, str) and hasattr(owner, "get_name"):
            name = owner.get_name()  # TF1 optimizers.
        return repr(name) if isinstance(name, str) else (
            f"member {self._index}")

    @property
    def good_steps(self):
        """The loss scale's good steps (iterations, here); a dynamic one's."""
        return self._group.loss_scale.good_steps

    @property
    def _needs_finiteness(self):
        return self._group.loss_scale._needs_finiteness  # pylint: disable=protected-access

    @property
    def _xla_record(self):
        return getattr(self._group.loss_scale, "_xla_record", None)

    def __call__(self):
        return self._group()

    def update(self, grads):
        """This member's step: `LossScale.update` of its gradients."""
        return loss_scale_lib.update_from_grads(self, grads)

    def _update_from_all_finite(self, all_finite, *, gated=True):
        if self._group.deferring_block() is not None:
            raise ValueError(
                "loss_scale.update() of a LossScaleGroup member cannot be "
                "deferred to the end of group.iteration(): call it outside "
                "the block (only optimizers' steps are deferred)")
        update_op, should_apply = self._group.step(
            [self], [all_finite], gated=gated)
        return update_op, should_apply[0]

    def get_config(self):
        """The group's config (`LossScaleGroup.get_config`)."""
        return self._group.get_config()

    def __repr__(self):
        return (f"GroupMember({self.name} of LossScaleGroup("
                f"{self._group.loss_scale!r}, skip={self._group.skip!r}))")

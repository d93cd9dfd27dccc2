"""`GroupMember`: one optimizer's share of a `LossScaleGroup`, and joining."""

import weakref

from tf_lossscale._internal import private_api
from tf_lossscale.loss_scales import loss_scale as loss_scale_lib
from tf_lossscale.ops import replicas

# Members are bits of an int64; the sign bit stays clear.
MAX_MEMBERS = 62
# No optimizer has joined yet, so none has told the strategy.
UNSET = object()


def underlying(loss_scale):
    """The loss scale itself: a member's group's, or `loss_scale`."""
    if isinstance(loss_scale, GroupMember):
        return loss_scale.group.loss_scale
    return loss_scale


class Membership:
    """Mixin of `LossScaleGroup`: its members, and joining it. The group
    sets `_strategy`, `_member_strategy` (`UNSET`), `_members` (a list)
    and `_members_mask` (None until the first step)."""

    @property
    def members(self):
        """The `GroupMember` of each optimizer that joined, in joining order."""
        return [member for member in (ref() for ref in self._members)
                if member is not None]

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
            raise ValueError("A LossScaleGroup takes at most "
                             f"{MAX_MEMBERS} optimizers")
        current = replicas.strategy_in_use()
        expected = (self._strategy if self._strategy is not None
                    else self._member_strategy)
        if expected is not UNSET and current is not expected:
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
        if self._strategy is None and self._member_strategy is UNSET:
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

    def _named_bits(self):
        """`(name, bit)` of each member, for messages."""
        return [(m.name, 1 << m.index) for m in self.members]


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
        for name, variable in [
                *getattr(inner, "_state_variables", {}).items(),
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

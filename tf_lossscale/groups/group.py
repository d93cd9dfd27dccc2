"""`LossScaleGroup`: one loss scale for several optimizers, one step of it per
training iteration.

Each optimizer given the group holds a `GroupMember` (`member`); the rule of
their steps is `iteration`'s. A refused step raises eagerly, is an assertion
in graphs, and under XLA is written in the loss scale's record. The why and
the how: docs/guides/several-optimizers.md.
"""

import contextlib
import threading
import weakref

import tensorflow as tf

from tf_lossscale._internal import checks
from tf_lossscale._internal import private_api
from tf_lossscale.groups import blocks
from tf_lossscale.groups import iteration
from tf_lossscale.groups import member
from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.loss_scales import failure_policy
from tf_lossscale.loss_scales import loss_scale as loss_scale_lib
from tf_lossscale.loss_scales import serialization
from tf_lossscale.loss_scales import xla_record
from tf_lossscale.ops import replicas

SKIP_RULES = ("each", "together")


def group_of(loss_scale):
    """The `LossScaleGroup` `loss_scale` is the loss scale of, or None."""
    group = loss_scale_lib.GROUPED.get(loss_scale)
    return None if group is None else group()


def _resolve(loss_scale):
    """The group's loss scale from its argument: "dynamic", a number, or a
    built-in `LossScale` (a config: `tf_lossscale.get(config)` first)."""
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return dynamic_loss_scale.DynamicLossScale()
    if isinstance(loss_scale, (int, float)) and not isinstance(
            loss_scale, bool):
        return loss_scale_lib.FixedLossScale(loss_scale)
    if isinstance(loss_scale, member.GroupMember):
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


@serialization.register
class LossScaleGroup(blocks.IterationBlocks, member.Membership,
                     private_api.Trackable):
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
        self._member_strategy = member.UNSET
        self._members = []  # Weak references, in joining order.
        self._members_mask = None  # Fixed at the first step.
        self._blocks = {}
        self._lock = threading.RLock()
        private_api.track(self, inner, "loss_scale")
        self._state_variables = {}
        if isinstance(inner, dynamic_loss_scale.DynamicLossScale):
            for name in (iteration.STEPPED, iteration.OVERFLOWED):
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

    def __call__(self):
        """The current loss scale, a scalar float32 tensor."""
        return self._loss_scale()

    def get_config(self):
        """`{"loss_scale": <serialized loss scale>, "skip": ...}`; the
        serialized group (`tf_lossscale.serialize`) has class name
        "LossScaleGroup" and loads with `tf_lossscale.deserialize`. A config
        holds no members: each optimizer made from one gets a group of its
        own."""
        return {"loss_scale": serialization.serialize(self._loss_scale),
                "skip": self._skip}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """A new group, with no member yet, from `get_config()`'s output.

        Raises:
          TypeError, ValueError: `config` is not a dict of the keys
            "loss_scale" (required) and "skip", or as `tf_lossscale.
            deserialize(config["loss_scale"], custom_objects)` and the
            constructor raise.
        """
        if not isinstance(config, dict):
            raise TypeError(
                "config['config'] of a LossScaleGroup must be a dict like "
                "{'loss_scale': {...}, 'skip': 'each'}, got "
                f"{checks.summary(config)}")
        if "loss_scale" not in config or set(config) - {"loss_scale", "skip"}:
            raise ValueError(
                "config['config'] of a LossScaleGroup takes the keys "
                f"'loss_scale' (required) and 'skip', got the keys "
                f"{checks.summary(list(config))}")
        return cls(serialization.deserialize(config["loss_scale"],
                                             custom_objects),
                   **{key: config[key] for key in config if key == "skip"})

    def __repr__(self):
        return (f"LossScaleGroup({self._loss_scale!r}, skip={self._skip!r}, "
                f"members={[m.name for m in self.members]!r})")

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
        if not self._state_variables:  # A fixed loss scale never moves.
            return loss_scale_lib.graph_op(tf.no_op()), (
                self._should_apply(flags, all_finite)
                if self._loss_scale._needs_finiteness  # pylint: disable=protected-access
                else [True] * len(flags))
        bits = sum(1 << m.index for m in members)
        stepped, overflowed = (tf.convert_to_tensor(v) for v in self.variables)
        moved = iteration.next_iteration(stepped, overflowed, bits, all_finite,
                                         self._members_bits(), ends_now)
        record = (self._loss_scale._xla_record  # pylint: disable=protected-access
                  if xla_record.in_xla_context() else None)
        eager_lock = (self._loss_scale._eager_lock if tf.executing_eagerly()  # pylint: disable=protected-access
                      else contextlib.nullcontext())
        with self._lock, eager_lock:
            if record is None:  # Raises eagerly; assertions in graphs.
                repeated, invalid = iteration.refusal_templates(
                    bits, self._named_bits())
                refusals = failure_policy.ops_of(failure_policy.fail_if(
                    moved.repeated, repeated, [stepped]))
                refusals += failure_policy.ops_of(failure_policy.fail_if(
                    tf.logical_and(moved.refused,
                                   tf.logical_not(moved.repeated)),
                    invalid, [stepped, overflowed]))
            else:  # Recorded for the host, with the values of its message.
                record.check_watched()
                refused, proceed = record.refuse(
                    moved.refused, [tf.constant(bits, tf.int64), stepped,
                                    overflowed])
                refusals = [refused]
                moved = moved._replace(
                    ends=tf.logical_and(proceed, moved.ends),
                    stepped=tf.where(proceed, moved.stepped, stepped),
                    overflowed=tf.where(proceed, moved.overflowed, overflowed))
            with tf.control_dependencies(refusals):
                assignments = [
                    variable.assign(value, read_value=False) for variable, value
                    in zip(self.variables, (moved.stepped, moved.overflowed))]
                scale_moved = tf.cond(
                    moved.ends, lambda: self._move_scale(moved.finite, gated),
                    lambda: tf.constant(True))
        should_apply = self._should_apply(flags, moved.finite)
        if tf.executing_eagerly():
            return None, should_apply
        update_op = tf.group(assignments + refusals + [scale_moved])
        with tf.control_dependencies([update_op]):
            if record is None:
                return update_op, [tf.identity(s) for s in should_apply]
            going_on = tf.logical_not(record.halted())
            return update_op, [tf.logical_and(s, going_on)
                               for s in should_apply]

    def _should_apply(self, flags, iteration_finite):
        if self._skip == "each":
            return list(flags)
        return [iteration_finite] * len(flags)

    def _move_scale(self, finite, gated):
        """The loss scale's step of the iteration; True once done (after its
        state check, assignments and failure policy)."""
        update_op, _ = self._loss_scale._step(finite, gated)  # pylint: disable=protected-access
        with tf.control_dependencies(failure_policy.ops_of(update_op)):
            return tf.constant(True)

    def _refusal_message(self, values):
        """The message of a refusal recorded under XLA (`xla_record.refuse`)."""
        return iteration.refusal_message(self._named_bits(), *values[:3])

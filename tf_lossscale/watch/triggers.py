"""The host-side test of a persistent float16 failure, from what the loss
scale already keeps: its scale, its floor and the wrapper's skipped steps.

One `Triggers` follows one optimizer over batch ends; it reads two numbers
per batch end and keeps the rest (the skips in a row, the settled scale) in
Python, so the step itself does nothing more.
"""

import math

import numpy as np

from tf_lossscale._internal import checks
from tf_lossscale import groups as group_lib


class Triggers:
    """Decides, after each batch end, whether a run has failed persistently.

    Args:
      max_consecutive_skips: a failure after this many steps in a row were
        skipped for non-finite gradients, once the scale has settled (the
        first skips of a run bring down too high a start); None: never on
        this count.
      nonfinite_loss_steps: a failure when the loss is not finite and the
        last this many steps were skipped (a NaN loss the loss scale cannot
        cure); None: never.
      scale_drop_binades: a failure when the scale falls this many powers
        of 2 below where it had settled; None: never.
      settle_steps: the scale has settled where it held this many steps in
        a row without a skip.
      at_floor: a failure when a step is skipped with the scale at its floor
        (`min_loss_scale`), where backing off no longer helps.
    """

    def __init__(self, max_consecutive_skips=20, nonfinite_loss_steps=3,
                 scale_drop_binades=10, settle_steps=50, at_floor=True):
        self.max_consecutive_skips = checks.optional_positive_int(
            "max_consecutive_skips", max_consecutive_skips)
        self.nonfinite_loss_steps = checks.optional_positive_int(
            "nonfinite_loss_steps", nonfinite_loss_steps)
        self.scale_drop_binades = None if scale_drop_binades is None else (
            checks.finite_float32("scale_drop_binades", scale_drop_binades,
                                  above=0))
        self.settle_steps = checks.positive_int("settle_steps", settle_steps)
        self.at_floor = checks.boolean("at_floor", at_floor)
        self.start(None)

    def start(self, optimizer):
        """Follows `optimizer` (a `tf_lossscale.LossScaleOptimizer`) from
        its present state; None forgets it."""
        self._optimizer = optimizer
        # `_clean`: steps without a skip since the last one.
        self.step = self.skips_in_a_row = self._clean = 0
        self.settled_scale = self.scale = self._skipped = None
        if optimizer is not None:
            self.scale, self._skipped = self._read()
            # Steps count on from the optimizer's (a run carried on too),
            # whose iterations count the applied ones.
            self.step = int(np.asarray(optimizer.iterations)) + self._skipped

    def _read(self):
        return (float(self._optimizer.loss_scale()),
                int(np.asarray(self._optimizer.skipped_steps)))

    def floor(self):
        """The scale's floor, or None (a fixed scale has none)."""
        scale = group_lib.underlying(self._optimizer.loss_scale)
        return getattr(scale, "min_loss_scale", None)

    def after(self, steps=1, loss=None):
        """Takes the end of `steps` steps (an execution of
        `steps_per_execution`), and the loss logged then; returns why the
        run failed (a sentence) or None."""
        previous = self.scale
        scale, skipped = self._read()
        new_skips = skipped - self._skipped
        self.step += steps
        self.scale, self._skipped = scale, skipped
        self._clean = 0 if new_skips else self._clean + steps
        # Which of an execution's steps were skipped is not kept: skips that
        # are not all of its steps are taken as its last ones.
        self.skips_in_a_row = new_skips + (
            self.skips_in_a_row if new_skips >= steps else 0)
        if self._clean >= self.settle_steps:
            self.settled_scale = scale
        return self._why(previous, scale, new_skips, loss)

    def _why(self, previous, scale, new_skips, loss):
        skips = self.skips_in_a_row
        if (self.nonfinite_loss_steps is not None and loss is not None
                and not math.isfinite(loss)
                and skips >= self.nonfinite_loss_steps):
            return (f"the loss is not finite ({loss}) and the last {skips} "
                    "steps were skipped: the forward pass no longer computes "
                    "in float16, whatever the loss scale")
        # Before the scale first settles, a burst of skips is the scale
        # coming down from too high a start, not a failure.
        if self.max_consecutive_skips is not None and (
                self.settled_scale is not None
                and skips >= self.max_consecutive_skips):
            return (f"{skips} steps in a row were skipped for non-finite "
                    f"gradients (the limit is {self.max_consecutive_skips}); "
                    f"loss scale {scale:g}")
        floor = self.floor()
        # A skip that found the scale at its floor: no back-off was left.
        if self.at_floor and new_skips and floor is not None and (
                previous <= floor):
            return (f"a step was skipped with the loss scale at its floor "
                    f"({floor:g}): backing off no longer helps")
        if (self.scale_drop_binades is not None and self.settled_scale
                and scale > 0 and math.log2(self.settled_scale / scale)
                >= self.scale_drop_binades):
            return (f"the loss scale fell to {scale:g}, "
                    f"{math.log2(self.settled_scale / scale):g} powers of 2 "
                    f"below where it had settled ({self.settled_scale:g})")
        return None

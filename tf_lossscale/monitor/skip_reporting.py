"""What `LossScaleMonitor(verbose=True)` prints about skipped steps,
rate-limited by bursts (see `tf_lossscale.monitor`): the first skip of a
burst gets one line, the rest one summary line when the burst ends, or
every `BURST_SUMMARY_SKIPS` skipped steps while it goes on.
"""

# Skips at most this many steps apart belong to one burst.
BURST_GAP_STEPS = 10
# A burst still going on is summarized after this many unreported skips.
BURST_SUMMARY_SKIPS = 100
# Variables named in a line; a large model can have hundreds overflow at once.
_MAX_NAMED_VARIABLES = 5


def steps(first, last):
    return f"step {last}" if first == last else f"steps {first}-{last}"


def variable_list(paths):
    named = ", ".join(paths[:_MAX_NAMED_VARIABLES])
    if len(paths) > _MAX_NAMED_VARIABLES:
        named += f" and {len(paths) - _MAX_NAMED_VARIABLES} more"
    return named or "none recorded"


class _Burst:
    """Skips since the last printed line of the current burst."""

    def __init__(self, last_step, scale):
        self.last_step = last_step
        self.count = 0
        self.first_step = None
        self.scale_before = scale
        self.scale_after = scale

    def add(self, count, first_step, last_step, scale_before, scale_after):
        if not self.count:
            self.first_step = first_step
            self.scale_before = scale_before
        self.count += count
        self.last_step = last_step
        self.scale_after = scale_after

    def summary(self):
        plural = "s" if self.count > 1 else ""
        return (f"LossScaleMonitor: {self.count} more skipped step{plural} in "
                f"{steps(self.first_step, self.last_step)}; loss scale "
                f"{self.scale_before!r} -> {self.scale_after!r}")


class SkipReporter:
    """Prints skipped steps for one `fit`, rate-limited by bursts.

    Args:
      optimizer: the tf_lossscale wrapper, asked which variables overflowed
        (`last_nonfinite_variables()`, one small read) on each printed skip.
      gap_steps: skips at most this many steps apart belong to one burst.
      summary_skips: a burst still going on is summarized after this many
        unreported skips.
    """

    def __init__(self, optimizer, gap_steps=BURST_GAP_STEPS,
                 summary_skips=BURST_SUMMARY_SKIPS):
        self._optimizer = optimizer
        self._gap_steps = gap_steps
        self._summary_skips = summary_skips
        self._burst = None

    def report(self, new_skips, first_step, last_step, scale_before,
               scale_after):
        """Takes the batch end covering `first_step`..`last_step`, in which
        `new_skips` steps were skipped and the scale went from
        `scale_before` to `scale_after`."""
        burst = self._burst
        if burst is not None and (
                first_step - burst.last_step > self._gap_steps + 1):
            self.end()
            burst = None
        if not new_skips:
            return
        if burst is None:
            self._print_skip(new_skips, first_step, last_step, scale_before,
                             scale_after)
            self._burst = _Burst(last_step, scale_after)
            return
        burst.add(new_skips, first_step, last_step, scale_before, scale_after)
        if burst.count >= self._summary_skips:
            print("\n" + burst.summary())
            self._burst = _Burst(last_step, scale_after)

    def _print_skip(self, new_skips, first_step, last_step, scale_before,
                    scale_after):
        if first_step == last_step:
            what = f"skipped step {last_step}"
        else:
            what = f"skipped {new_skips} of {steps(first_step, last_step)}"
        variables = self._optimizer.last_nonfinite_variables()
        print(f"\nLossScaleMonitor: {what}; loss scale {scale_before!r} -> "
              f"{scale_after!r}; non-finite gradients: "
              f"{variable_list(variables)}")

    def end(self):
        """Prints what the current burst has not printed yet."""
        if self._burst is not None and self._burst.count:
            print("\n" + self._burst.summary())
        self._burst = None

"""`Float16Diagnosis`: the figures of `tf_lossscale.diagnose`, its advice,
and three ways to read them (text, a dict, a plot).

Headroom is counted in powers of 2 below float16's largest value, 65504
(2**15.9994): a headroom of 3 means the value could grow 8-fold before it
overflows; a negative headroom means it does not fit. An output's or a
variable's gradient headroom is that of its gradient at loss scale 1, so it
is also the log2 of the largest loss scale that gradient can take.

The advice:

* the loss scale range: its top is the largest probed scale up to which
  the float16 backward pass (outputs' gradients of float16 layers
  included, not only the variables' gradients) overflowed on at most
  `overflow_tolerance` of the batches (5%: none of fewer than 20),
  measured; its bottom the smallest probed scale at which every float16
  variable loses at most `underflow_tolerance` (1%) more of its gradient to
  underflow than at the top;
* the layers to keep in float32: float16 layers whose outputs reach within
  a factor 2 of 65504 (`ACTIVATION_MARGIN_LOG2`) or beyond it, layers whose
  gradients still underflow at the top of the range, and, when even the
  lowest probed scale overflows, the layers whose gradients overflow there.
"""

import math

import numpy as np

from tf_lossscale.diagnosis import advice as advice_lib
from tf_lossscale.diagnosis import text
from tf_lossscale.ops import float16

# Default tolerances: the share of batches that may overflow at the top of
# the advised range, and how much more of a gradient may underflow at its
# bottom than at its top.
OVERFLOW_TOLERANCE = 0.05
UNDERFLOW_TOLERANCE = 0.01
ACTIVATION_MARGIN_LOG2 = advice_lib.ACTIVATION_MARGIN_LOG2


def headroom_log2(largest):
    """log2(65504 / largest); None for no value (0 or not measured)."""
    if largest is None or largest == 0 or math.isnan(largest):
        return None
    if math.isinf(largest):
        return -math.inf
    return float16.FLOAT16_MAX_LOG2 - math.log2(largest)


def _float_or_none(value, keep):
    return float(value) if keep else None


class Float16Diagnosis:
    """The result of `tf_lossscale.diagnose`: what float16 did to a model on
    a few batches, and what to change.

    `print(report)` (or `str(report)`) gives a readable report;
    `as_dict()` the same figures as plain Python values; `plot(path)` a
    figure. Attributes: `loss_scale_range` (`(lowest, highest)` advised, or
    None), `keep_in_float32` (layer names), `first_nonfinite_layer` (a
    layer name or None), `underflowing_variables` (variable names).
    """

    def __init__(self, *, layers, variables, scales, batches, replicas,
                 overflow_tolerance, underflow_tolerance, **figures):
        self._scales = [float(s) for s in scales]
        self._batches = batches
        self._replicas = replicas
        self._overflow_tolerance = overflow_tolerance
        self._tolerance = underflow_tolerance
        self._layers = [dict(row) for row in layers]
        self._variables = [dict(row) for row in variables]
        self._input_nonfinite = int(figures["input_nonfinite_batches"])
        self._forward_nonfinite = int(figures["forward_nonfinite_batches"])
        self._overflow = [int(n) for n in figures["overflow_batches"]]
        self._fill_layers(figures)
        self._fill_variables(figures)
        self.first_nonfinite_layer = next(
            (row["name"] for row in self._layers
             if row["nonfinite_batches"]), None)
        self._top = advice_lib.top_index(
            self._overflow, self._measured_batches(),
            self._overflow_tolerance)
        self._bottom = advice_lib.bottom_index(
            self._top, self._variables, self._tolerance)
        self.loss_scale_range = (
            None if self._top is None else
            (self._scales[self._bottom], self._scales[self._top]))
        self.underflowing_variables = [
            row["name"] for row in self._variables
            if row["underflow_share"] is not None
            and row["underflow_share"][0] > self._tolerance]
        self._reasons = advice_lib.float32_reasons(
            self._layers, self._variables, self._scales, self._top,
            self._measured_batches(), self._tolerance)
        self.keep_in_float32 = list(self._reasons)

    # Figures.

    def _fill_layers(self, figures):
        for index, row in enumerate(self._layers):
            reached = bool(figures["gradient_reached"][index])
            float32_max = float(figures["activation_max_float32"][index])
            gradient_max = _float_or_none(figures["gradient_max"][index],
                                          reached)
            # Against float16's range only where float16 holds the values.
            in_float16 = row["compute_dtype"] == "float16"
            row.update(
                activation_max=float(figures["activation_max"][index]),
                activation_max_float32=float32_max,
                activation_headroom_log2=(
                    headroom_log2(float32_max) if in_float16 else None),
                gradient_max=gradient_max,
                gradient_headroom_log2=(
                    headroom_log2(gradient_max) if in_float16 else None),
                nonfinite_batches=int(
                    figures["output_nonfinite_batches"][index]))

    def _measured_batches(self):
        """Batches whose float16 forward pass was finite: the only ones
        whose backward pass can be compared."""
        return self._batches - self._forward_nonfinite - self._input_nonfinite

    def _fill_variables(self, figures):
        underflow = np.asarray(figures["underflow"])
        for index, row in enumerate(self._variables):
            nonzero = float(figures["nonzero"][index])
            largest = float(figures["variable_gradient_max"][index])
            measured = row["compute_dtype"] == "float16" and (
                self._measured_batches() > 0)
            row.update(
                gradient_max=largest,
                gradient_headroom_log2=(
                    headroom_log2(largest)
                    if row["compute_dtype"] == "float16" else None),
                nonzero_values=int(nonzero),
                underflow_share=(
                    [float(u / nonzero) if nonzero else 0.0
                     for u in underflow[:, index]] if measured else None),
                nonfinite_batches=[
                    int(n) for n in
                    np.asarray(figures["variable_nonfinite_batches"])[
                        :, index]])

    def overflow_bound_log2(self):
        """log2 of the largest loss scale the float16 gradients measured in
        float32 allow (outputs' and variables' gradients of float16 layers);
        None if no such gradient was measured."""
        largest = [row["gradient_max"] for row in self._layers
                   if row["compute_dtype"] == "float16"
                   and row["gradient_max"]]
        largest += [row["gradient_max"] for row in self._variables
                    if row["compute_dtype"] == "float16"
                    and row["gradient_max"]]
        return headroom_log2(max(largest)) if largest else None

    # Advice in words.

    def advice(self):
        """The advice, as a list of sentences."""
        lines = self._cause_lines() + self._scale_lines()
        for name, reason in self._reasons.items():
            lines.append(f"Keep layer {name!r} in float32 (dtype=\"float32\"):"
                         f" {reason}.")
        return lines or ["Nothing to change."]

    def _cause_lines(self):
        lines = []
        if self._input_nonfinite:
            lines.append(
                f"{self._input_nonfinite} of {self._batches} batches hold NaN "
                "or Inf in their inputs: fix the data; no dtype or loss scale "
                "helps with that.")
        if self.first_nonfinite_layer is not None:
            lines.append(
                f"The forward pass in float16 is not finite from layer "
                f"{self.first_nonfinite_layer!r} on: no loss scale helps "
                "(loss scaling acts on gradients only).")
        return lines

    def _scale_lines(self):
        lines = []
        if self.loss_scale_range is not None:
            lines.append(self._range_line())
        elif self._measured_batches() > 0 and (
                self.first_nonfinite_layer is None):
            lines.append(
                "The float16 backward pass overflows even at loss scale "
                f"{text.pow2(self._scales[0])}: no loss scale in the probed "
                "range avoids it.")
        if self.underflowing_variables:
            names = ", ".join(self.underflowing_variables[:5])
            more = len(self.underflowing_variables) - 5
            names += f" and {more} more" if more > 0 else ""
            lines.append(
                f"At loss scale {text.pow2(self._scales[0])} more than "
                f"{text.share(self._tolerance)} of the gradient underflows "
                f"for: {names}.")
        return lines

    def _range_line(self):
        low, high = self.loss_scale_range
        between = (f"of {text.pow2(low)}" if low == high else
                   f"between {text.pow2(low)} and {text.pow2(high)}")
        if self._top == len(self._scales) - 1:
            between += (f" (no overflow up to {text.pow2(high)}, the largest "
                        "scale probed)")
        return (f"Use a loss scale {between}: above it the float16 backward "
                "pass overflows on more than "
                f"{text.share(self._overflow_tolerance)} of the batches, "
                "below it more gradient values underflow. A DynamicLossScale "
                "finds the top by itself; "
                f"FixedLossScale({text.python_number(high)}) is the fixed "
                "choice.")

    # The three views.

    def as_dict(self):
        """The report as plain Python values (lists, dicts, floats, ints,
        strings, None)."""
        return {
            "batches": self._batches,
            "replicas": self._replicas,
            "scales": list(self._scales),
            "float16": {"max": float16.FLOAT16_MAX,
                        "min_normal": float16.FLOAT16_MIN_NORMAL,
                        "min_subnormal": float16.FLOAT16_MIN_SUBNORMAL},
            "overflow_tolerance": self._overflow_tolerance,
            "underflow_tolerance": self._tolerance,
            "input_nonfinite_batches": self._input_nonfinite,
            "forward_nonfinite_batches": self._forward_nonfinite,
            "first_nonfinite_layer": self.first_nonfinite_layer,
            "overflow_batches": list(self._overflow),
            "overflow_bound_log2": self.overflow_bound_log2(),
            "layers": [dict(row) for row in self._layers],
            "variables": [
                dict(row, underflow_share=(
                    None if row["underflow_share"] is None
                    else list(row["underflow_share"])),
                     nonfinite_batches=list(row["nonfinite_batches"]))
                for row in self._variables],
            "loss_scale_range": (None if self.loss_scale_range is None
                                 else list(self.loss_scale_range)),
            "keep_in_float32": list(self.keep_in_float32),
            "underflowing_variables": list(self.underflowing_variables),
            "advice": self.advice(),
        }

    def __str__(self):
        return text.render(self.as_dict())

    def __repr__(self):
        return (f"<Float16Diagnosis: {self._batches} batches, loss scale "
                f"range {self.loss_scale_range}, keep in float32: "
                f"{self.keep_in_float32}>")

    def plot(self, path):
        """Writes a PNG: each float16 layer's headroom (outputs and output
        gradients), and each float16 variable's underflow share over the
        probed loss scales with the overflowing scales and the advised
        range marked.

        Needs matplotlib (the "plot" extra).

        Raises:
          ImportError: matplotlib is not installed; the message names the
            extra.
        """
        # pylint: disable=g-import-not-at-top
        from tf_lossscale.diagnosis import plot
        plot.write(self, path)

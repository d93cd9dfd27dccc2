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

from tf_lossscale import gradient_stats

# Default tolerances: the share of batches that may overflow at the top of
# the advised range, and how much more of a gradient may underflow at its
# bottom than at its top.
OVERFLOW_TOLERANCE = 0.05
UNDERFLOW_TOLERANCE = 0.01
# Outputs within this many powers of 2 of 65504 are too close: another
# batch may overflow.
ACTIVATION_MARGIN_LOG2 = 1.0
# Rows of the variables table printed by `str()`; `as_dict()` has them all.
_MAX_PRINTED_VARIABLES = 30


def headroom_log2(largest):
    """log2(65504 / largest); None for no value (0 or not measured)."""
    if largest is None or largest == 0 or math.isnan(largest):
        return None
    if math.isinf(largest):
        return -math.inf
    return gradient_stats.FLOAT16_MAX_LOG2 - math.log2(largest)


def _pow2(value):
    """2^k text for a power of 2, else the number."""
    if value is None:
        return "-"
    exponent = math.log2(value) if value > 0 else None
    if exponent is not None and exponent == round(exponent):
        return f"2^{int(exponent)}"
    return f"{value:g}"


def _python_number(value):
    """`value` as Python source: 2**k for a power of 2."""
    exponent = math.log2(value)
    if exponent == round(exponent) and exponent > 10:
        return f"2**{int(exponent)}"
    return f"{value:g}"


def _log2_text(value):
    if value is None:
        return "-"
    if math.isinf(value):
        return "-inf" if value < 0 else "inf"
    return f"{value:.1f}"


def _number(value):
    if value is None:
        return "-"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.3g}"


def _share(value):
    return "-" if value is None else f"{100 * value:.1f}%"


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
        self._top = self._top_index()
        self._bottom = self._bottom_index()
        self.loss_scale_range = (
            None if self._top is None else
            (self._scales[self._bottom], self._scales[self._top]))
        self.underflowing_variables = [
            row["name"] for row in self._variables
            if row["underflow_share"] is not None
            and row["underflow_share"][0] > self._tolerance]
        self._reasons = self._float32_reasons()
        self.keep_in_float32 = list(self._reasons)

    # Figures.

    def _fill_layers(self, figures):
        for index, row in enumerate(self._layers):
            reached = bool(figures["gradient_reached"][index])
            float32_max = float(figures["activation_max_float32"][index])
            gradient_max = _float_or_none(figures["gradient_max"][index],
                                          reached)
            # Against float16's range only where float16 holds the values.
            float16 = row["compute_dtype"] == "float16"
            row.update(
                activation_max=float(figures["activation_max"][index]),
                activation_max_float32=float32_max,
                activation_headroom_log2=(
                    headroom_log2(float32_max) if float16 else None),
                gradient_max=gradient_max,
                gradient_headroom_log2=(
                    headroom_log2(gradient_max) if float16 else None),
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

    def _top_index(self):
        """The last of the probed scales, from the lowest up, at which at
        most `overflow_tolerance` of the batches overflowed (the batches
        whose forward pass was finite); None if none."""
        measured = self._measured_batches()
        if measured <= 0:
            return None
        top = None
        for index, batches in enumerate(self._overflow):
            if batches > self._overflow_tolerance * measured:
                break
            top = index
        return top

    def _float16_shares(self):
        return [row["underflow_share"] for row in self._variables
                if row["underflow_share"] is not None]

    def _bottom_index(self):
        if self._top is None:
            return None
        shares = self._float16_shares()
        for index in range(self._top + 1):
            if all(share[index] <= share[self._top] + self._tolerance
                   for share in shares):
                return index
        return self._top

    def _float32_reasons(self):
        """{layer name: why it should compute in float32}, in layer order."""
        reasons = {}
        for row in self._layers:
            headroom = row["activation_headroom_log2"]
            if row["compute_dtype"] == "float16" and headroom is not None and (
                    headroom < ACTIVATION_MARGIN_LOG2):
                reasons[row["name"]] = (
                    f"its outputs reach {_number(row['activation_max_float32'])}"
                    f" ({'above' if headroom < 0 else 'close to'} float16's "
                    "65504)")
        for row in self._variables:
            share = row["underflow_share"]
            if (share is not None and self._top is not None
                    and share[self._top] > self._tolerance):
                reasons.setdefault(row["layer"], (
                    f"{_share(share[self._top])} of {row['name']}'s gradient "
                    f"underflows even at {_pow2(self._scales[self._top])}"))
        if self._top is None and not self._forward_nonfinite and (
                not self._input_nonfinite):
            lowest = self._scales[0]
            for row in self._layers + self._variables:
                largest = row.get("gradient_max")
                if row["compute_dtype"] == "float16" and largest and (
                        largest * lowest > gradient_stats.FLOAT16_MAX):
                    name = row.get("layer", row["name"])
                    reasons.setdefault(name, (
                        f"gradients reach {_number(largest * lowest)} at loss "
                        f"scale {_pow2(lowest)}, above float16's 65504"))
        return reasons

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
        if self.loss_scale_range is not None:
            low, high = self.loss_scale_range
            top_note = ""
            if self._top == len(self._scales) - 1:
                top_note = (f" (no overflow up to {_pow2(high)}, the largest "
                            "scale probed)")
            lines.append(
                f"Use a loss scale between {_pow2(low)} and {_pow2(high)}"
                f"{top_note}: above it the float16 backward pass overflows "
                f"on more than {_share(self._overflow_tolerance)} of the "
                "batches, below it more gradient values underflow. A "
                "DynamicLossScale finds the top by itself; "
                f"FixedLossScale({_python_number(high)}) is the fixed "
                "choice.")
        elif not self._input_nonfinite and self.first_nonfinite_layer is None:
            lines.append(
                f"The float16 backward pass overflows even at loss scale "
                f"{_pow2(self._scales[0])}: no loss scale in the probed range "
                "avoids it.")
        if self.underflowing_variables:
            names = ", ".join(self.underflowing_variables[:5])
            more = len(self.underflowing_variables) - 5
            names += f" and {more} more" if more > 0 else ""
            lines.append(
                f"At loss scale {_pow2(self._scales[0])} more than "
                f"{_share(self._tolerance)} of the gradient underflows for: "
                f"{names}.")
        for name, reason in self._reasons.items():
            lines.append(f"Keep layer {name!r} in float32 (dtype=\"float32\"):"
                         f" {reason}.")
        if not lines:
            lines.append("Nothing to change.")
        return lines

    # The three views.

    def as_dict(self):
        """The report as plain Python values (lists, dicts, floats, ints,
        strings, None)."""
        return {
            "batches": self._batches,
            "replicas": self._replicas,
            "scales": list(self._scales),
            "float16": {"max": gradient_stats.FLOAT16_MAX,
                        "min_normal": gradient_stats.FLOAT16_MIN_NORMAL,
                        "min_subnormal": gradient_stats.FLOAT16_MIN_SUBNORMAL},
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
        return "\n".join(self._text_lines())

    def __repr__(self):
        return (f"<Float16Diagnosis: {self._batches} batches, loss scale "
                f"range {self.loss_scale_range}, keep in float32: "
                f"{self.keep_in_float32}>")

    def _text_lines(self):
        lines = [
            f"float16 diagnosis: {self._batches} batches, "
            f"{self._replicas} replica{'s' if self._replicas > 1 else ''}, "
            f"loss scales {_pow2(self._scales[0])} to "
            f"{_pow2(self._scales[-1])}",
            "float16 holds magnitudes up to 65504 (2^16); headroom: powers of "
            "2 left below it",
            "",
            "Forward pass, each layer's largest output:",
            f"  {'layer':<24} {'dtype':<8} {'float16':>10} {'float32':>10} "
            f"{'headroom':>9}"]
        for row in self._layers:
            mark = ("  <- first non-finite output"
                    if row["name"] == self.first_nonfinite_layer else "")
            lines.append(
                f"  {row['name']:<24} {row['compute_dtype']:<8} "
                f"{_number(row['activation_max']):>10} "
                f"{_number(row['activation_max_float32']):>10} "
                f"{_log2_text(row['activation_headroom_log2']):>9}{mark}")
        lines += [
            "",
            "Backward pass, each layer's largest output gradient at loss "
            "scale 1 (headroom: log2 of the largest scale it takes):",
            f"  {'layer':<24} {'dtype':<8} {'largest':>10} {'headroom':>9}"]
        for row in self._layers:
            lines.append(
                f"  {row['name']:<24} {row['compute_dtype']:<8} "
                f"{_number(row['gradient_max']):>10} "
                f"{_log2_text(row['gradient_headroom_log2']):>9}")
        lines += ["", *self._variable_lines(), "", *self._overflow_lines(),
                  "", "Advice:"]
        lines += [f"  * {line}" for line in self.advice()]
        return lines

    def _shown_scales(self):
        indices = [0]
        for index in (self._bottom, self._top):
            if index is not None and index not in indices:
                indices.append(index)
        return indices

    def _variable_lines(self):
        shown = self._shown_scales()
        header = "".join(f"{'at ' + _pow2(self._scales[i]):>9}"
                         for i in shown)
        lines = [
            "Variables, share of the float16 gradient lost to underflow "
            "(zero or subnormal where the float32 gradient is not 0):",
            f"  {'variable':<32} {'dtype':<8}{header} {'largest':>10} "
            f"{'headroom':>9}"]
        for row in self._variables[:_MAX_PRINTED_VARIABLES]:
            share = row["underflow_share"]
            cells = "".join(
                f"{_share(None if share is None else share[i]):>9}"
                for i in shown)
            lines.append(
                f"  {row['name']:<32} {row['compute_dtype']:<8}{cells} "
                f"{_number(row['gradient_max']):>10} "
                f"{_log2_text(row['gradient_headroom_log2']):>9}")
        hidden = len(self._variables) - _MAX_PRINTED_VARIABLES
        if hidden > 0:
            lines.append(f"  ... and {hidden} more (as_dict() has them all)")
        return lines

    def _overflow_lines(self):
        first = next((i for i, n in enumerate(self._overflow) if n), None)
        if self._measured_batches() <= 0:
            return ["Backward pass: not measured (no batch with a finite "
                    "forward pass)."]
        if first is None:
            return [f"Backward pass: no overflow up to "
                    f"{_pow2(self._scales[-1])}."]
        return [f"Backward pass: overflows from {_pow2(self._scales[first])} "
                f"on ({self._overflow[first]} of {self._batches} batches "
                "there)."]

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
        from tf_lossscale import diagnosis_plot
        diagnosis_plot.write(self, path)

    # What the plot reads.

    def plotted(self):
        """The figures `plot` draws: a dict of plain values."""
        layers = [row for row in self._layers
                  if row["compute_dtype"] == "float16"]
        return {
            "layers": [row["name"] for row in layers],
            "activation_headroom": [row["activation_headroom_log2"]
                                    for row in layers],
            "gradient_headroom": [row["gradient_headroom_log2"]
                                  for row in layers],
            "scales_log2": [math.log2(s) for s in self._scales],
            "shares": {row["name"]: row["underflow_share"]
                       for row in self._variables
                       if row["underflow_share"] is not None},
            "overflowing_log2": [math.log2(s) for s, n in
                                 zip(self._scales, self._overflow) if n],
            "range_log2": (None if self.loss_scale_range is None else
                           [math.log2(s) for s in self.loss_scale_range]),
        }

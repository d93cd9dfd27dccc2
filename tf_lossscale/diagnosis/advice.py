"""The advice of a float16 diagnosis, from its figures (`as_dict()`'s): the
range of loss scales (as indices of the probed scales), the layers to keep
in float32 with their reasons, and the advice in words."""

from tf_lossscale.diagnosis import text
from tf_lossscale.ops import float16

# Outputs within this many powers of 2 of 65504 are too close: another
# batch may overflow.
ACTIVATION_MARGIN_LOG2 = 1.0


def measured_batches(figures):
    """Batches whose float16 forward pass was finite: those whose backward
    pass is measured."""
    return (figures["batches"] - figures["input_nonfinite_batches"]
            - figures["forward_nonfinite_batches"])


def top_index(figures, overflow_tolerance):
    """The last probed scale, from the lowest up, at which at most
    `overflow_tolerance` of the measured batches overflowed; None if none."""
    measured = measured_batches(figures)
    top = None
    for index, batches in enumerate(figures["overflow_batches"]):
        if measured <= 0 or batches > overflow_tolerance * measured:
            break
        top = index
    return top


def bottom_index(top, variables, tolerance):
    """The lowest probed scale at which every float16 variable loses at
    most `tolerance` more of its gradient to underflow than at `top`."""
    shares = [row["underflow_share"] for row in variables
              if row["underflow_share"] is not None]
    return next(index for index in range(top + 1) if all(
        share[index] <= share[top] + tolerance for share in shares))


def float16_gradients(figures):
    """`(layer name, largest gradient)` of each float16 layer's outputs and
    variables whose gradient was measured."""
    return [(row.get("layer", row["name"]), row["gradient_max"])
            for row in figures["layers"] + figures["variables"]
            if row["compute_dtype"] == "float16" and row["gradient_max"]]


def float32_reasons(figures, top, tolerance):
    """{layer name: why it should compute in float32}: each layer's first
    reason."""
    reasons = {}
    for name, reason in (
            _output_reasons(figures["layers"])
            + _underflow_reasons(figures, top, tolerance)
            + _overflow_reasons(figures, top)):
        reasons.setdefault(name, reason)
    return reasons


def _output_reasons(layers):
    reasons = []
    for row in layers:
        headroom = row["activation_headroom_log2"]
        if headroom is not None and headroom < ACTIVATION_MARGIN_LOG2:
            where = "above" if headroom < 0 else "close to"
            reasons.append((row["name"], (
                "its outputs reach "
                f"{text.number(row['activation_max_float32'])} ({where} "
                "float16's 65504)")))
    return reasons


def _underflow_reasons(figures, top, tolerance):
    if top is None:
        return []
    return [(row["layer"], (
        f"{text.share(row['underflow_share'][top])} of {row['name']}'s "
        f"gradient underflows even at {text.pow2(figures['scales'][top])}"))
            for row in figures["variables"]
            if row["underflow_share"] is not None
            and row["underflow_share"][top] > tolerance]


def _overflow_reasons(figures, top):
    """When even the lowest scale overflows: the float16 layers whose
    gradients (of outputs or variables) overflow there."""
    if top is not None or measured_batches(figures) <= 0:
        return []
    lowest = figures["scales"][0]
    return [(name, f"gradients reach {text.number(largest * lowest)} at loss "
                   f"scale {text.pow2(lowest)}, above float16's 65504")
            for name, largest in float16_gradients(figures)
            if largest * lowest > float16.FLOAT16_MAX]


def sentences(figures, reasons):
    """The advice as a list of sentences; `figures` is `as_dict()` without
    its advice, `reasons` those of `float32_reasons`."""
    lines, first = [], figures["first_nonfinite_layer"]
    lowest = text.pow2(figures["scales"][0])
    if figures["input_nonfinite_batches"]:
        lines.append(
            f"{figures['input_nonfinite_batches']} of {figures['batches']} "
            "batches hold NaN or Inf in their inputs: fix the data; no dtype "
            "or loss scale helps with that.")
    if first is not None:
        lines.append(
            f"The forward pass in float16 is not finite from layer {first!r} "
            "on: no loss scale helps (loss scaling acts on gradients only).")
    if figures["loss_scale_range"] is not None:
        lines.append(_range_line(figures))
    elif measured_batches(figures) > 0 and first is None:
        lines.append(
            f"The float16 backward pass overflows even at loss scale {lowest}"
            ": no loss scale in the probed range avoids it.")
    names = figures["underflowing_variables"]
    if names:
        listed = ", ".join(names[:5]) + (
            f" and {len(names) - 5} more" if len(names) > 5 else "")
        lines.append(
            f"At loss scale {lowest} more than "
            f"{text.share(figures['underflow_tolerance'])} of the gradient "
            f"underflows for: {listed}.")
    lines += [f"Keep layer {name!r} in float32 (dtype=\"float32\"): "
              f"{reason}." for name, reason in reasons.items()]
    if _needs_bfloat16(figures):
        lines.append(
            "No loss scale helps and most float16 layers would be float32: "
            "consider mixed_bfloat16 (float32's range, no loss scaling; 8 "
            "significant bits to float16's 11; fast only on hardware that "
            "computes in bfloat16).")
    return lines or ["Nothing to change."]


def _needs_bfloat16(figures):
    if figures["loss_scale_range"] is not None or not (
            figures["first_nonfinite_layer"] or measured_batches(figures)):
        return False
    half = [row["name"] for row in figures["layers"]
            if row["compute_dtype"] == "float16"]
    kept = [name for name in half if name in figures["keep_in_float32"]]
    return 2 * len(kept) > len(half)


def _range_line(figures):
    low, high = figures["loss_scale_range"]
    between = (f"of {text.pow2(low)}" if low == high else
               f"between {text.pow2(low)} and {text.pow2(high)}")
    if high == figures["scales"][-1]:
        between += (f" (no overflow up to {text.pow2(high)}, the largest "
                    "scale probed)")
    return (f"Use a loss scale {between}: above it the float16 backward pass "
            "overflows on more than "
            f"{text.share(figures['overflow_tolerance'])} of the batches, "
            "below it more gradient values underflow. A DynamicLossScale "
            "finds the top by itself; "
            f"FixedLossScale({text.pow2(high, python=True)}) is the fixed "
            "choice.")

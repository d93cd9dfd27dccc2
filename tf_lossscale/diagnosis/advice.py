"""The advice of a float16 diagnosis, from its figures (`as_dict()`'s): the
layers to keep in float32 with their reasons, and the advice in words."""

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


def float16_gradients(figures):
    """`(layer name, largest gradient)` of each float16 layer's outputs and
    variables whose gradient was measured."""
    return [(row.get("layer", row["name"]), row["gradient_max"])
            for row in figures["layers"] + figures["variables"]
            if row["compute_dtype"] == "float16" and row["gradient_max"]]


def float32_reasons(figures, top, tolerance, underflow=True):
    """{layer name: why it should compute in float32}: each layer's first
    reason; without `underflow`, not for gradients that underflow at the
    top of the range (which scaling each layer's gradients can keep)."""
    reasons = [(row["name"], (
        f"its outputs reach {text.number(row['activation_max_float32'])} "
        f"({'above' if row['activation_headroom_log2'] < 0 else 'close to'}"
        " float16's 65504)")) for row in figures["layers"]
               if row["activation_headroom_log2"] is not None
               and row["activation_headroom_log2"] < ACTIVATION_MARGIN_LOG2]
    # The first layer whose float16 outputs are not finite, where float32
    # holds them: it overflows inside (attention scores, a variance).
    first = next((row for row in figures["layers"]
                  if row["nonfinite_batches"]), None)
    if first is not None and first["compute_dtype"] == "float16":
        reasons.append((first["name"], (
            "its float16 outputs are not finite where float32's reach "
            f"{text.number(first['activation_max_float32'])}: it overflows "
            "inside (a sum or product over many values, such as attention "
            "scores)")))
    # The advised top, or the lowest scale when even that overflows.
    scale = figures["scales"][0 if top is None else top]
    if top is not None and underflow:
        reasons += [(row["layer"], (
            f"float16 loses {text.share(row['underflow_share'][top])} of "
            f"{row['name']}'s gradient values to underflow even at "
            f"{text.pow2(scale)}, {text.share(row['underflow_norm_share'][top])}"
            " of the layer's float32 gradient norm"))
                    for row in figures["variables"]
                    if row["underflow_cost"] is not None
                    and row["underflow_cost"][top] > tolerance]
    elif measured_batches(figures) > 0:
        reasons += [(name, f"gradients reach {text.number(largest * scale)} "
                           f"at loss scale {text.pow2(scale)}, above "
                           "float16's 65504")
                    for name, largest in float16_gradients(figures)
                    if largest * scale > float16.FLOAT16_MAX]
    first_reasons = {}
    for name, reason in reasons:
        first_reasons.setdefault(name, reason)
    return first_reasons


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
        low, high = figures["loss_scale_range"]
        between = (f"of {text.pow2(low)}" if low == high else
                   f"between {text.pow2(low)} and {text.pow2(high)}")
        if high == figures["scales"][-1]:
            between += (f" (no overflow up to {text.pow2(high)}, the largest "
                        "scale probed)")
        lines.append(
            f"Use a loss scale {between}: above it the float16 backward pass "
            "overflows on more than "
            f"{text.share(figures['overflow_tolerance'])} of the batches, "
            "below it underflow costs some variable's gradient more than "
            f"{text.share(figures['underflow_tolerance'])} of its layer's "
            "gradient norm beyond what it costs at the top. A DynamicLossScale "
            "finds the top by itself; "
            f"FixedLossScale({text.pow2(high, python=True)}) is the fixed "
            "choice.")
    elif measured_batches(figures) > 0 and first is None:
        lines.append(
            f"The float16 backward pass overflows even at loss scale {lowest}"
            ": no loss scale in the probed range avoids it.")
    names = figures["underflowing_variables"]
    if names:
        listed = ", ".join(names[:5]) + (
            f" and {len(names) - 5} more" if len(names) > 5 else "")
        lines.append(
            f"At loss scale {lowest} float16 loses more than "
            f"{text.share(figures['underflow_tolerance'])} of the gradient "
            "values to underflow, carrying more than that share of their "
            f"layer's float32 gradient norm, for: {listed}.")
    lines += [f"Keep layer {name!r} in float32 (dtype=\"float32\"): "
              f"{reason}." for name, reason in reasons.items()]
    scaled = [name for name in reasons
              if name in figures["per_layer_scalable"]]
    if scaled:
        lines.append(
            f"Or keep {', '.join(map(repr, scaled))} in float16 and give "
            "their gradients a scale of their own: "
            "report.fix(model, per_layer=True) (tf_lossscale.layerwise, "
            "Keras 3).")
    # For each float16 layer: whether the advice keeps it in float32.
    kept = [row["name"] in figures["keep_in_float32"]
            for row in figures["layers"]
            if row["compute_dtype"] == "float16"]
    if figures["loss_scale_range"] is None and (
            first or measured_batches(figures)) and 2 * sum(kept) > len(kept):
        lines.append(
            "No loss scale helps and most float16 layers would be float32: "
            "consider mixed_bfloat16 (float32's range, no loss scaling; 8 "
            "significant bits to float16's 11; fast only on hardware that "
            "computes in bfloat16).")
    return lines or ["Nothing to change."]

"""The advice of `tf_lossscale.diagnose` worked out from its figures (see
`tf_lossscale.diagnosis.report` for what it means): the advised range of
loss scales, as positions among the probed scales, and the layers to keep
in float32, each with its reason.

The figures are `Float16Diagnosis`'s rows: a dict per layer and per
variable (`compute_dtype`, `gradient_max`, `activation_headroom_log2`,
`activation_max_float32`, `underflow_share` per probed scale, ...).
"""

from tf_lossscale.diagnosis import text
from tf_lossscale.ops import float16

# Outputs within this many powers of 2 of 65504 are too close: another
# batch may overflow.
ACTIVATION_MARGIN_LOG2 = 1.0


def top_index(overflow, measured, overflow_tolerance):
    """The last of the probed scales, from the lowest up, at which at most
    `overflow_tolerance` of the `measured` batches (those whose forward pass
    was finite) overflowed (`overflow`: a count per scale); None if
    none."""
    if measured <= 0:
        return None
    top = None
    for index, batches in enumerate(overflow):
        if batches > overflow_tolerance * measured:
            break
        top = index
    return top


def bottom_index(top, variables, tolerance):
    """The lowest probed scale at which every float16 variable loses at
    most `tolerance` more of its gradient to underflow than at `top`."""
    if top is None:
        return None
    shares = [row["underflow_share"] for row in variables
              if row["underflow_share"] is not None]
    for index in range(top + 1):
        if all(share[index] <= share[top] + tolerance for share in shares):
            return index
    return top


def float32_reasons(layers, variables, scales, top, measured, tolerance):
    """{layer name: why it should compute in float32}, in layer order."""
    reasons = {}
    for name, reason in (
            _output_reasons(layers)
            + _underflow_reasons(variables, scales, top, tolerance)
            + _overflow_reasons(layers + variables, scales, top, measured)):
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


def _underflow_reasons(variables, scales, top, tolerance):
    if top is None:
        return []
    return [(row["layer"], (
        f"{text.share(row['underflow_share'][top])} of {row['name']}'s "
        f"gradient underflows even at {text.pow2(scales[top])}"))
            for row in variables
            if row["underflow_share"] is not None
            and row["underflow_share"][top] > tolerance]


def _overflow_reasons(rows, scales, top, measured):
    """When even the lowest scale overflows: the float16 layers whose
    gradients (of outputs or variables) overflow there."""
    if top is not None or measured <= 0:
        return []
    lowest = scales[0]
    reasons = []
    for row in rows:
        largest = row["gradient_max"]
        if row["compute_dtype"] == "float16" and largest and (
                largest * lowest > float16.FLOAT16_MAX):
            reasons.append((row.get("layer", row["name"]), (
                f"gradients reach {text.number(largest * lowest)} at "
                f"loss scale {text.pow2(lowest)}, above float16's "
                "65504")))
    return reasons

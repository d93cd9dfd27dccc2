"""The readable report of a float16 diagnosis, from its dict
(`Float16Diagnosis.as_dict()`), and the number formats it uses."""

import math

# Rows of the variables table; the dict has them all.
MAX_PRINTED_VARIABLES = 30


def pow2(value):
    """2^k text for a power of 2, else the number."""
    if value is None:
        return "-"
    exponent = math.log2(value) if value > 0 else None
    if exponent is not None and exponent == round(exponent):
        return f"2^{int(exponent)}"
    return f"{value:g}"


def python_number(value):
    """`value` as Python source: 2**k for a large power of 2."""
    exponent = math.log2(value)
    if exponent == round(exponent) and exponent > 10:
        return f"2**{int(exponent)}"
    return f"{value:g}"


def log2_text(value):
    if value is None:
        return "-"
    if math.isinf(value):
        return "-inf" if value < 0 else "inf"
    return f"{value:.1f}"


def number(value):
    if value is None:
        return "-"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.3g}"


def share(value):
    return "-" if value is None else f"{100 * value:.1f}%"


def render(report):
    """The report as text; `report` is `Float16Diagnosis.as_dict()`."""
    scales = report["scales"]
    replicas = report["replicas"]
    lines = [
        f"float16 diagnosis: {report['batches']} batches, {replicas} "
        f"replica{'s' if replicas > 1 else ''}, loss scales "
        f"{pow2(scales[0])} to {pow2(scales[-1])}",
        "float16 holds magnitudes up to 65504 (2^16); headroom: powers of 2 "
        "left below it",
        "", *_forward_lines(report), "", *_backward_lines(report), "",
        *_variable_lines(report), "", _overflow_line(report), "", "Advice:"]
    lines += [f"  * {line}" for line in report["advice"]]
    return "\n".join(lines)


def _forward_lines(report):
    lines = ["Forward pass, each layer's largest output:",
             f"  {'layer':<24} {'dtype':<8} {'float16':>10} {'float32':>10} "
             f"{'headroom':>9}"]
    for row in report["layers"]:
        mark = ("  <- first non-finite output"
                if row["name"] == report["first_nonfinite_layer"] else "")
        lines.append(
            f"  {row['name']:<24} {row['compute_dtype']:<8} "
            f"{number(row['activation_max']):>10} "
            f"{number(row['activation_max_float32']):>10} "
            f"{log2_text(row['activation_headroom_log2']):>9}{mark}")
    return lines


def _backward_lines(report):
    lines = ["Backward pass, each layer's largest output gradient at loss "
             "scale 1 (headroom: log2 of the largest scale it takes):",
             f"  {'layer':<24} {'dtype':<8} {'largest':>10} {'headroom':>9}"]
    for row in report["layers"]:
        lines.append(
            f"  {row['name']:<24} {row['compute_dtype']:<8} "
            f"{number(row['gradient_max']):>10} "
            f"{log2_text(row['gradient_headroom_log2']):>9}")
    return lines


def _shown_scales(report):
    """Indices of the scales in the variables table: the lowest probed,
    then the advised range's ends."""
    shown = [0]
    for scale in report["loss_scale_range"] or ():
        index = report["scales"].index(scale)
        if index not in shown:
            shown.append(index)
    return shown


def _variable_lines(report):
    shown = _shown_scales(report)
    header = "".join(f"{'at ' + pow2(report['scales'][i]):>9}"
                     for i in shown)
    lines = ["Variables, share of the float16 gradient lost to underflow "
             "(zero or subnormal where the float32 gradient is not 0):",
             f"  {'variable':<32} {'dtype':<8}{header} {'largest':>10} "
             f"{'headroom':>9}"]
    variables = report["variables"]
    for row in variables[:MAX_PRINTED_VARIABLES]:
        shares = row["underflow_share"]
        cells = "".join(
            f"{share(None if shares is None else shares[i]):>9}"
            for i in shown)
        lines.append(
            f"  {row['name']:<32} {row['compute_dtype']:<8}{cells} "
            f"{number(row['gradient_max']):>10} "
            f"{log2_text(row['gradient_headroom_log2']):>9}")
    hidden = len(variables) - MAX_PRINTED_VARIABLES
    if hidden > 0:
        lines.append(f"  ... and {hidden} more (as_dict() has them all)")
    return lines


def _overflow_line(report):
    batches = report["batches"]
    measured = batches - report["forward_nonfinite_batches"] - report[
        "input_nonfinite_batches"]
    if measured <= 0:
        return ("Backward pass: not measured (no batch with a finite "
                "forward pass).")
    overflow = report["overflow_batches"]
    first = next((i for i, n in enumerate(overflow) if n), None)
    if first is None:
        top = pow2(report["scales"][-1])
        return f"Backward pass: no overflow up to {top}."
    return (f"Backward pass: overflows from {pow2(report['scales'][first])} "
            f"on ({overflow[first]} of {batches} batches there).")

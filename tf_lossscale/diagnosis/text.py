"""The readable report of a float16 diagnosis, from its dict
(`Float16Diagnosis.as_dict()`), and the number formats it uses."""

import math

# Rows of the variables table; the dict has them all.
MAX_PRINTED_VARIABLES = 30


def pow2(value, python=False):
    """2^k for a power of 2, else the number; as Python source (2**k for
    powers above 2**10) with `python`."""
    exponent = math.log2(value)
    if exponent == round(exponent) and (exponent > 10 or not python):
        return f"2{'**' if python else '^'}{int(exponent)}"
    return f"{value:g}"


def number(value, digits=".3g"):
    return "-" if value is None else format(value, digits)


def share(value):
    return "-" if value is None else f"{100 * value:.1f}%"


def render(report):
    """The report as text; `report` is `Float16Diagnosis.as_dict()`."""
    scales, replicas = report["scales"], report["replicas"]
    lines = [
        f"float16 diagnosis: {report['batches']} batches, {replicas} "
        f"replica{'s' if replicas > 1 else ''}, loss scales "
        f"{pow2(scales[0])} to {pow2(scales[-1])}",
        "float16 holds magnitudes up to 65504 (2^16); headroom: powers of 2 "
        "left below it", "",
        "Forward pass, each layer's largest output:",
        f"  {'layer':<24} {'dtype':<8} {'float16':>10} {'float32':>10} "
        f"{'headroom':>9}"]
    lines += [f"  {row['name']:<24} {row['compute_dtype']:<8} "
              f"{number(row['activation_max']):>10} "
              f"{number(row['activation_max_float32']):>10} "
              f"{number(row['activation_headroom_log2'], '.1f'):>9}"
              + ("  <- first non-finite output"
                 if row["name"] == report["first_nonfinite_layer"] else "")
              for row in report["layers"]]
    lines += ["", "Backward pass, each layer's largest output gradient at "
              "loss scale 1 (headroom: log2 of the largest scale it takes):",
              f"  {'layer':<24} {'dtype':<8} {'largest':>10} {'headroom':>9}"]
    lines += [f"  {row['name']:<24} {row['compute_dtype']:<8} "
              f"{number(row['gradient_max']):>10} "
              f"{number(row['gradient_headroom_log2'], '.1f'):>9}"
              for row in report["layers"]]
    lines += ["", *_variable_lines(report), "", _overflow_line(report), "",
              "Advice:"]
    return "\n".join(lines + [f"  * {line}" for line in report["advice"]])


def _variable_lines(report):
    # The lowest probed scale, then the advised range's ends.
    shown = sorted({0} | {report["scales"].index(scale)
                          for scale in report["loss_scale_range"] or ()})
    header = "".join(f"{'at ' + pow2(report['scales'][i]):>14}"
                     for i in shown)
    lines = ["Variables, what float16 underflow loses of their gradient: the "
             "share of its values/the share of the layer's float32 gradient "
             "norm they carry; and the share of that norm the variable "
             "carries (underflow costs training where both shares are "
             "large):",
             f"  {'variable':<32} {'dtype':<8}{header} {'carries':>8} "
             f"{'largest':>10} {'headroom':>9}"]
    variables = report["variables"]
    for row in variables[:MAX_PRINTED_VARIABLES]:
        values = row["underflow_share"] or [None] * len(report["scales"])
        norms = row["underflow_norm_share"] or [None] * len(report["scales"])
        lines.append(f"  {row['name']:<32} {row['compute_dtype']:<8}"
                     + "".join(f"{share(values[i]) + '/' + share(norms[i]):>14}"
                               for i in shown)
                     + f" {share(row['gradient_norm_share']):>8}"
                     f" {number(row['gradient_max']):>10} "
                     f"{number(row['gradient_headroom_log2'], '.1f'):>9}")
    if len(variables) > MAX_PRINTED_VARIABLES:
        lines.append(f"  ... and {len(variables) - MAX_PRINTED_VARIABLES} "
                     "more (as_dict() has them all)")
    return lines


def _overflow_line(report):
    if report["batches"] <= report["forward_nonfinite_batches"] + report[
            "input_nonfinite_batches"]:
        return ("Backward pass: not measured (no batch with a finite "
                "forward pass).")
    overflow, scales = report["overflow_batches"], report["scales"]
    first = next((i for i, n in enumerate(overflow) if n), None)
    if first is None:
        return f"Backward pass: no overflow up to {pow2(scales[-1])}."
    return (f"Backward pass: overflows from {pow2(scales[first])} on "
            f"({overflow[first]} of {report['batches']} batches there).")

"""The figures of a float16 diagnosis as `Float16Diagnosis.as_dict` holds
them: its passes' figures (`passes.py`) combined over the batches into
counts, and one row per layer that ran and per variable."""

import numpy as np

from tf_lossscale.diagnosis import text
from tf_lossscale.ops import float16


def figures(runs, batches, scales, progress):
    """The figures of `batches` at `scales` run by `runs` (a
    `passes.Passes`), with `progress` (a `progress.Progress`)."""
    float32_runs, float16_runs = [], []
    for index, batch in enumerate(batches):
        run32, run16 = runs.run_batch(batch, scales, progress)
        float32_runs.append(run32)
        float16_runs.append(run16)
        overflow = [scale for scale, overflowed in zip(
            scales, run16["backward_overflow"][:, 0]) if overflowed]
        progress.line(
            f"batch {index + 1}/{len(batches)}: float32 twin, float16 "
            + ("forward pass not finite" if run16["forward_nonfinite"][0]
               or run16["input_nonfinite"][0] else
               f"backward pass overflows from {text.pow2(overflow[0])}"
               if overflow else "no overflow at any scale"))
    # Over the batches: maxima of the float32 figures and of the outputs,
    # sums of the rest.
    f32 = {key: np.max([run[key] for run in float32_runs], axis=0)
           for key in float32_runs[0]}
    f16 = {key: (np.max if key == "activation_max" else np.sum)(
        [run[key] for run in float16_runs], axis=0) for key in float16_runs[0]}
    counts = {
        "batches": len(batches),
        "replicas": runs.replicas,
        "input_nonfinite_batches": int(f16["input_nonfinite"][0]),
        "forward_nonfinite_batches": int(f16["forward_nonfinite"][0]),
        "overflow_batches": (
            f16["backward_overflow"][:, 0].astype(int).tolist()),
    }
    measured = (counts["batches"] - counts["input_nonfinite_batches"]
                - counts["forward_nonfinite_batches"])
    return dict(counts, layers=_layer_rows(runs, f32, f16),
                variables=_variable_rows(runs, f32, f16, measured > 0))


def _layer_rows(runs, f32, f16):
    rows = []
    for index in runs.called:
        half = runs.layer_dtypes[index] == "float16"
        largest = float(f32["activation_max_float32"][index])
        gradient = (float(f32["gradient_max"][index])
                    if runs.reached[index] else None)
        rows.append({
            "name": runs.layer_paths[index],
            "compute_dtype": runs.layer_dtypes[index],
            "activation_max": float(f16["activation_max"][index]),
            "activation_max_float32": largest,
            "activation_headroom_log2": (
                float16.headroom_log2(largest) if half else None),
            "gradient_max": gradient,
            "gradient_headroom_log2": (
                float16.headroom_log2(gradient) if half else None),
            "nonfinite_batches": int(f16["output_nonfinite"][index]),
        })
    return rows


def _variable_rows(runs, f32, f16, measured):
    half = np.array(runs.float16_variable)
    # Each layer's float32 gradient norm (squared), over its float16 variables:
    # what underflow's losses are measured against.
    totals = {}
    for layer, squares in zip(runs.variable_layers, np.where(
            half, f16["reference_squares"], 0.0)):
        totals[layer] = totals.get(layer, 0.0) + squares
    total = np.array([totals[layer] for layer in runs.variable_layers])
    count = f16["nonzero"]
    values = _share(f16["underflow"], count)
    # At most all of it: where float16 rounds a tiny value up to the
    # smallest subnormal, the difference exceeds the value.
    norms = np.minimum(1.0, np.sqrt(_share(f16["lost_squares"], total)))
    # Both: many values (range, not the rounding of a few), carrying a
    # material part of the layer's gradient (not noise).
    costs = np.minimum(values, norms)
    carries = np.sqrt(_share(f16["reference_squares"], total))
    rows = []
    for index, (variable, layer) in enumerate(zip(
            runs.variables, runs.variable_layers)):
        largest = float(f32["variable_gradient_max"][index])
        shown = half[index] and measured
        rows.append({
            # A Keras 3 variable's path, or a tf-keras variable's name.
            "name": getattr(variable, "path", None) or variable.name,
            "layer": layer,
            "compute_dtype": "float16" if half[index] else "float32",
            "size": int(np.prod(variable.shape)),
            "gradient_max": largest,
            "gradient_headroom_log2": (
                float16.headroom_log2(largest) if half[index] else None),
            "nonzero_values": int(count[index]),
            "gradient_norm_share": (
                float(carries[index]) if shown else None),
            **{key: figure[:, index].tolist() if shown else None
               for key, figure in (("underflow_share", values),
                                   ("underflow_norm_share", norms),
                                   ("underflow_cost", costs))},
            "nonfinite_batches": (
                f16["variable_nonfinite"][:, index].astype(int).tolist()),
        })
    return rows


def _share(part, whole):
    """`part / whole` in float64, 0 where `whole` is 0."""
    part = np.asarray(part, np.float64)
    return np.divide(part, whole, where=whole > 0,
                     out=np.zeros(np.broadcast(part, whole).shape))

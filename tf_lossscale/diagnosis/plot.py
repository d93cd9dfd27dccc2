"""The figure of a float16 diagnosis (`Float16Diagnosis.plot`), drawn by
matplotlib (the "plot" extra) with its Agg backend, not pyplot: it needs no
display and leaves pyplot's state alone."""

import math
import pathlib


def write(report, path):
    """Writes the figure of `report` (`Float16Diagnosis.as_dict()`) to
    `path` as a PNG."""
    try:
        # pylint: disable=g-import-not-at-top
        from matplotlib import figure
        from matplotlib.backends import backend_agg
    except ImportError as err:
        raise ImportError(
            "Float16Diagnosis.plot needs matplotlib, which is not installed: "
            'pip install "tf_lossscale[plot]" (in a source checkout: '
            'pip install -e ".[plot]")') from err
    fig = figure.Figure(figsize=(10, 4.2), dpi=100, layout="constrained")
    backend_agg.FigureCanvasAgg(fig)
    layers_axes, axes = fig.subplots(1, 2, width_ratios=[1, 1.3])
    _draw_headroom(layers_axes, [row for row in report["layers"]
                                 if row["compute_dtype"] == "float16"])
    # Each float16 variable's underflow share over the probed scales.
    scales = [math.log2(s) for s in report["scales"]]
    shares = {row["name"]: row["underflow_cost"]
              for row in report["variables"]
              if row["underflow_cost"] is not None}
    for name, values in shares.items():
        axes.plot(scales, [100 * s for s in values], marker=".", label=name)
    for exponent, overflowed in zip(scales, report["overflow_batches"]):
        if overflowed:
            axes.axvspan(exponent - 0.5, exponent + 0.5, color="tab:red",
                         alpha=0.12, linewidth=0)
    if report["loss_scale_range"] is not None:
        low, high = (math.log2(s) for s in report["loss_scale_range"])
        axes.axvspan(low - 0.5, high + 0.5, color="tab:green", alpha=0.12,
                     linewidth=0, label="advised loss scales")
    axes.set(xlabel="log2 of the loss scale (red: the backward pass "
             "overflows)", ylabel="underflow cost (%)",
             title="float16 variables")
    axes.grid(True, alpha=0.3)
    # No legend without a labelled line (every float16 layer overflowed).
    if len(shares) <= 10 and axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize="small")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def _draw_headroom(axes, layers):
    """Each float16 layer's headroom: not measured as 0, -inf below the
    lowest finite bar."""
    bars = {"outputs": [row["activation_headroom_log2"] for row in layers],
            "output gradients at scale 1": [row["gradient_headroom_log2"]
                                            for row in layers]}
    lowest = min([-2.0] + [v for values in bars.values() for v in values
                           if v is not None and v > -math.inf]) - 1
    height = 0.4
    for offset, color, (label, values) in zip(
            (-height / 2, height / 2), ("tab:blue", "tab:orange"),
            bars.items()):
        axes.barh([p + offset for p in range(len(layers))],
                  [0.0 if v is None else max(v, lowest) for v in values],
                  height, color=color, label=label)
    axes.axvline(0, color="tab:red", linewidth=1)
    axes.set_yticks(list(range(len(layers))), [row["name"] for row in layers])
    axes.invert_yaxis()
    axes.set(xlabel="headroom below 65504 (powers of 2)",
             title="float16 layers")
    axes.legend(loc="lower right", fontsize="small")
    axes.grid(True, axis="x", alpha=0.3)

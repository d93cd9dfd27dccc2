"""The figure of a `Float16Diagnosis` (`report.plot(path)`).

Needs matplotlib, the "plot" extra; draws with its Agg backend, not pyplot,
so it works without a display and leaves pyplot's state alone.
"""

import math
import pathlib


def _require_matplotlib():
    try:
        # pylint: disable=g-import-not-at-top,unused-import
        from matplotlib import figure  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "Float16Diagnosis.plot needs matplotlib, which is not installed: "
            'pip install "tf_lossscale[plot]" (in a source checkout: '
            'pip install -e ".[plot]")') from err


def _finite_or(values, fallback):
    """Headrooms to draw: None (not measured) as 0, -inf as `fallback`."""
    return [0.0 if v is None else max(v, fallback) for v in values]


def _plotted(report):
    """What the figure draws, from the report's dict."""
    figures = report.as_dict()
    layers = [row for row in figures["layers"]
              if row["compute_dtype"] == "float16"]
    scales = figures["scales"]
    return {
        "layers": [row["name"] for row in layers],
        "activation_headroom": [row["activation_headroom_log2"]
                                for row in layers],
        "gradient_headroom": [row["gradient_headroom_log2"]
                              for row in layers],
        "scales_log2": [math.log2(s) for s in scales],
        "shares": {row["name"]: row["underflow_share"]
                   for row in figures["variables"]
                   if row["underflow_share"] is not None},
        "overflowing_log2": [math.log2(s) for s, n in
                             zip(scales, figures["overflow_batches"]) if n],
        "range_log2": (None if figures["loss_scale_range"] is None else
                       [math.log2(s) for s in figures["loss_scale_range"]]),
    }


def write(report, path):
    """Writes `report`'s figure to `path` as a PNG."""
    _require_matplotlib()
    # pylint: disable=g-import-not-at-top
    from matplotlib import figure
    from matplotlib.backends import backend_agg
    data = _plotted(report)
    fig = figure.Figure(figsize=(10, 4.2), dpi=100, layout="constrained")
    backend_agg.FigureCanvasAgg(fig)
    layers_axes, shares_axes = fig.subplots(1, 2, width_ratios=[1, 1.3])
    _draw_headroom(layers_axes, data)
    _draw_shares(shares_axes, data)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def _draw_headroom(axes, data):
    names = data["layers"]
    positions = range(len(names))
    lowest = min([-2.0] + [v for v in data["activation_headroom"]
                           + data["gradient_headroom"]
                           if v is not None and v > float("-inf")])
    height = 0.4
    axes.barh([p - height / 2 for p in positions],
              _finite_or(data["activation_headroom"], lowest - 1), height,
              color="tab:blue", label="outputs")
    axes.barh([p + height / 2 for p in positions],
              _finite_or(data["gradient_headroom"], lowest - 1), height,
              color="tab:orange", label="output gradients at scale 1")
    axes.axvline(0, color="tab:red", linewidth=1)
    axes.set_yticks(list(positions), names)
    axes.invert_yaxis()
    axes.set_xlabel("headroom below 65504 (powers of 2)")
    axes.set_title("float16 layers")
    axes.legend(loc="lower right", fontsize="small")
    axes.grid(True, axis="x", alpha=0.3)


def _draw_shares(axes, data):
    scales = data["scales_log2"]
    for name, shares in data["shares"].items():
        axes.plot(scales, [100 * s for s in shares], marker=".",
                  label=name)
    for exponent in data["overflowing_log2"]:
        axes.axvspan(exponent - 0.5, exponent + 0.5, color="tab:red",
                     alpha=0.12, linewidth=0)
    if data["range_log2"] is not None:
        low, high = data["range_log2"]
        axes.axvspan(low - 0.5, high + 0.5, color="tab:green", alpha=0.12,
                     linewidth=0, label="advised loss scales")
    axes.set_xlabel("log2 of the loss scale (red: the backward pass "
                    "overflows)")
    axes.set_ylabel("gradient lost to underflow (%)")
    axes.set_title("float16 variables")
    axes.grid(True, alpha=0.3)
    if len(data["shares"]) <= 10:
        axes.legend(fontsize="small")

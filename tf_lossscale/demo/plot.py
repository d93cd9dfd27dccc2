"""The demo's plot: the loss scale over the steps, skipped steps marked."""

import pathlib

import numpy as np


def plot_loss_scale(result, path):
    """Writes a PNG of `result`'s loss scale over the steps to `path`, with
    matplotlib's Agg backend (not pyplot): the "plot" extra."""
    # pylint: disable=g-import-not-at-top
    from matplotlib.backends import backend_agg
    from matplotlib import figure
    # Step k ran with the scale before it, loss_scales[k - 1].
    steps = np.arange(1, len(result.loss_scales))
    used = np.asarray(result.loss_scales[:-1])
    skipped = np.asarray(result.skipped_at, dtype=int)
    fig = figure.Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    backend_agg.FigureCanvasAgg(fig)
    axes = fig.add_subplot()
    # Calibration: the skips that run without a break from step 1.
    calibration = next((i for i, step in enumerate(result.skipped_at)
                        if step != i + 1), len(result.skipped_at))
    if calibration:
        axes.axvspan(0.5, calibration + 0.5, color="tab:orange", alpha=0.15,
                     label=f"calibration (steps 1-{calibration})")
    axes.step(steps, used, where="post", color="tab:blue",
              label="loss scale the step ran with")
    axes.plot(skipped, used[skipped - 1], "v", color="tab:red",
              label=f"skipped step, scale halved ({len(skipped)})")
    axes.set_yscale("log", base=2)
    axes.set(xlim=(0, len(steps) + 1), ylabel="loss scale (log2 axis)",
             xlabel="optimizer step (applied or skipped)")
    axes.set_title(f"{len(steps)} float16 steps: {result.applied_steps} "
                   f"applied, {result.skipped_steps} skipped")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="upper right")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")

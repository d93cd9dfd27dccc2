"""`Float16Diagnosis`: what `tf_lossscale.diagnose` measured, its advice, a
loss scale, a fixed model, and three views (text, a dict, a plot)."""

import copy

from tf_lossscale.diagnosis import advice as advice_lib
from tf_lossscale.diagnosis import fix as fix_lib
from tf_lossscale.diagnosis import text
from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.ops import float16


class Float16Diagnosis:
    """The result of `tf_lossscale.diagnose`: what float16 did to a model on
    a few batches, and what to change.

    `print(report)` gives a readable report, `as_dict()` the same figures as
    plain Python values, `plot(path)` a figure; `loss_scale()` a loss scale
    for the advised range and `fix(model)` the model rebuilt to train.
    Attributes: `loss_scale_range` (`(lowest, highest)` advised, or None),
    `keep_in_float32` (layer names), `first_nonfinite_layer` (a layer name
    or None), `underflowing_variables` (variable names). For `fix`, it keeps
    what `diagnose` ran with: references to its batches, and its loss.
    """

    def __init__(self, figures, arguments, diagnose):
        self._figures = figures
        self._arguments = arguments
        self._diagnose = diagnose
        self.first_nonfinite_layer = next(
            (row["name"] for row in figures["layers"]
             if row["nonfinite_batches"]), None)
        scales = figures["scales"] = arguments["scales"]
        tolerance = arguments["underflow_tolerance"]
        top = advice_lib.top_index(figures, arguments["overflow_tolerance"])
        self.loss_scale_range = None
        if top is not None:
            bottom = advice_lib.bottom_index(top, figures["variables"],
                                             tolerance)
            self.loss_scale_range = (scales[bottom], scales[top])
        self.underflowing_variables = [
            row["name"] for row in figures["variables"]
            if row["underflow_share"] is not None
            and row["underflow_share"][0] > tolerance]
        self._reasons = advice_lib.float32_reasons(figures, top, tolerance)
        self.keep_in_float32 = list(self._reasons)

    def loss_scale(self):
        """A new `DynamicLossScale` for the advised range `(low, high)`:
        starting at `max(low, high / 2)`, with `low` as its floor and no
        ceiling; `DynamicLossScale()` without a range. Create it under the
        strategy's scope to share it between replicas."""
        if self.loss_scale_range is None:
            return dynamic_loss_scale.DynamicLossScale()
        low, high = self.loss_scale_range
        return dynamic_loss_scale.DynamicLossScale(
            initial_loss_scale=max(low, high / 2), min_loss_scale=low)

    def fix(self, model):
        """A new compiled model: `model` (the one diagnosed, compiled)
        rebuilt with its weights and the layers float16 cannot hold in
        float32, and more of them until the same batches' forward pass is
        finite; every other layer keeps its dtype policy. Compiled as
        `model` was, with a `LossScaleOptimizer` around a new inner optimizer
        from the original's config and the new model's `loss_scale()`.
        `model` is left as it was. What carries over and what does not:
        docs/guides/float16-troubleshooting.md.

        Raises:
          TypeError: `model` is not a functional or Sequential model, or
            cannot be rebuilt from its config.
          ValueError: `model` is not the model diagnosed, or not compiled;
            no choice of float32 layers makes the forward pass finite (NaN
            or Inf in the inputs, or in a float32 layer's outputs).
        """
        return fix_lib.fixed_model(model, self.as_dict(), self._arguments,
                                   self._diagnose)

    def overflow_bound_log2(self):
        """log2 of the largest loss scale the float16 gradients measured in
        float32 allow (outputs' and variables' gradients of float16 layers);
        None if no such gradient was measured."""
        largest = [g for _, g in advice_lib.float16_gradients(self._figures)]
        return float16.headroom_log2(max(largest)) if largest else None

    def advice(self):
        """The advice, as a list of sentences."""
        return self.as_dict()["advice"]

    def as_dict(self):
        """The report as plain Python values (lists, dicts, floats, ints,
        strings, None)."""
        figures = copy.deepcopy(self._figures)
        figures.update(
            float16={"max": float16.FLOAT16_MAX,
                     "min_normal": float16.FLOAT16_MIN_NORMAL,
                     "min_subnormal": float16.FLOAT16_MIN_SUBNORMAL},
            overflow_tolerance=self._arguments["overflow_tolerance"],
            underflow_tolerance=self._arguments["underflow_tolerance"],
            first_nonfinite_layer=self.first_nonfinite_layer,
            overflow_bound_log2=self.overflow_bound_log2(),
            loss_scale_range=(None if self.loss_scale_range is None
                              else list(self.loss_scale_range)),
            keep_in_float32=list(self.keep_in_float32),
            underflowing_variables=list(self.underflowing_variables))
        figures["advice"] = advice_lib.sentences(figures, self._reasons)
        return figures

    def __str__(self):
        return text.render(self.as_dict())

    def __repr__(self):
        return (f"<Float16Diagnosis: {self._figures['batches']} batches, loss "
                f"scale range {self.loss_scale_range}, keep in float32: "
                f"{self.keep_in_float32}>")

    def plot(self, path):
        """Writes a PNG: each float16 layer's headroom (outputs and output
        gradients), and each float16 variable's underflow share over the
        probed loss scales, the overflowing ones and the advised range marked.

        Raises:
          ImportError: matplotlib, the "plot" extra, is not installed.
        """
        # pylint: disable=g-import-not-at-top
        from tf_lossscale.diagnosis import plot
        plot.write(self.as_dict(), path)

"""`Float16Diagnosis`: what `tf_lossscale.diagnose` measured, its advice, a
loss scale, a fixed model, and three views (text, a dict, a plot)."""

import copy
import warnings

from tf_lossscale import layerwise
from tf_lossscale._internal import checks
from tf_lossscale.diagnosis import advice as advice_lib
from tf_lossscale.diagnosis import models
from tf_lossscale.diagnosis import text
from tf_lossscale.keras3 import loss_scale_optimizer
from tf_lossscale.loss_scales import dynamic_loss_scale
from tf_lossscale.ops import float16


class Float16Diagnosis:
    """The result of `tf_lossscale.diagnose`: what float16 did to a model on
    a few batches, and what to change.

    `print(report)` gives a readable report, `as_dict()` the same figures as
    plain Python values, `plot(path)` a figure; `loss_scale()` a loss scale
    for the advised range and `fix(model)` the model rebuilt to train.
    Attributes: `loss_scale_range` (`(lowest, highest)` advised, or None),
    `keep_in_float32` (layer names), `keep_in_float32_per_layer` (those of
    them that need float32 even with gradients scaled per layer: the ones
    that overflow), `first_nonfinite_layer` (a layer name
    or None), `underflowing_variables` (variable names). Layers are named
    by their paths (`"ffn/dense_1"` inside a nested model). For `fix`, it
    keeps what `diagnose` ran with: references to its batches, and its loss.
    """

    def __init__(self, figures, arguments, diagnose, layer_paths):
        self._figures = figures
        self._arguments = arguments
        self._diagnose = diagnose
        self._layer_paths = layer_paths
        self.first_nonfinite_layer = next(
            (row["name"] for row in figures["layers"]
             if row["nonfinite_batches"]), None)
        scales = figures["scales"] = arguments["scales"]
        tolerance = arguments["underflow_tolerance"]
        # The advised range's top: the last scale, from the lowest up, at
        # which at most overflow_tolerance of the measured batches overflow.
        measured = advice_lib.measured_batches(figures)
        limit = arguments["overflow_tolerance"] * measured
        fits = [measured > 0 and batches <= limit
                for batches in figures["overflow_batches"]] + [False]
        top = fits.index(False) - 1 if fits[0] else None
        self.loss_scale_range = None
        if top is not None:
            # Its bottom: the lowest scale at which every float16 variable
            # loses at most `tolerance` more of its layer's gradient norm
            # than at the top.
            shares = [row["underflow_cost"]
                      for row in figures["variables"]
                      if row["underflow_cost"] is not None]
            bottom = next(index for index in range(top + 1) if all(
                share[index] <= share[top] + tolerance for share in shares))
            self.loss_scale_range = (scales[bottom], scales[top])
        self.underflowing_variables = [
            row["name"] for row in figures["variables"]
            if row["underflow_cost"] is not None
            and row["underflow_cost"][0] > tolerance]
        self._reasons = advice_lib.float32_reasons(figures, top, tolerance)
        self.keep_in_float32 = list(self._reasons)
        self.keep_in_float32_per_layer = list(advice_lib.float32_reasons(
            figures, top, tolerance, underflow=False))

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

    def fix(self, model, per_layer=False, *, optimizer=None, also=()):
        """A new compiled model: `model` rebuilt with its weights and the
        layers float16 cannot hold in float32, more of them until the same
        batches' forward pass is finite; every other layer keeps its dtype
        policy, and every layer is checked to compute as intended. Compiled
        as `model` was, with a `LossScaleOptimizer` around a new inner
        optimizer from the original's config and the new model's
        `loss_scale()`. `model` is left as it was. What carries over and what
        does not: docs/guides/float16-troubleshooting.md.

        Args:
          model: the model diagnosed, compiled.
          per_layer: keep in float16 the layers advised into float32 only
            for gradients that underflow, and scale the model's gradients
            per layer instead (`tf_lossscale.layerwise.scale_per_layer`,
            Keras 3 only; segments where `gradient_maxima()` part): a
            `LayerwiseModel` (one given is copied with its segments and
            factor state).
          optimizer: keyword-only: a new, unbuilt `LossScaleOptimizer` to
            compile with, to carry a run on (`tf_lossscale.watch`).
          also: keyword-only: more layers to compute in float32.

        Warns when every layer ends in float32 (mixed precision off), and
        when a float32 layer sits inside a layer whose config cannot say so
        (a KerasHub backbone's blocks): a model rebuilt from its saved config
        would not compute it in float32.

        Raises:
          TypeError: `model` is not a functional or Sequential model, or
            cannot be rebuilt from its config, or a layer cannot be made to
            compute in float32 in the copy; with `per_layer`, a model
            `scale_per_layer` does not take (tf-keras).
          ValueError: `model` is not the model diagnosed, or not compiled;
            no choice of float32 layers makes the forward pass finite (NaN
            or Inf in the inputs, or in a float32 layer's outputs); with
            `per_layer`, gradient magnitudes that do not part (one loss
            scale holds them: one segment).
        """
        models.check_model(model, "fix")
        per_layer = checks.boolean("per_layer", per_layer)
        names = [path for path, _ in models.leaf_layers(model)]
        if names != self._layer_paths:
            raise ValueError(
                f"model {model.name!r} is not the model this report "
                f"diagnosed: its layers are {names}")
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                f"model {model.name!r} is not compiled: fix compiles its copy "
                "with the original's loss, metrics and optimizer")
        if self._figures["input_nonfinite_batches"]:
            raise ValueError(
                f"{self._figures['input_nonfinite_batches']} of "
                f"{self._figures['batches']} diagnosed batches hold NaN or "
                "Inf in their inputs: no choice of float32 layers makes the "
                "forward pass finite; fix the data")
        unknown = [name for name in also if name not in names]
        if isinstance(also, str) or unknown:
            raise ValueError(f"also must name layers of model {model.name!r}"
                             f", got {checks.summary(also)}")
        keep = set(self.keep_in_float32_per_layer if per_layer
                   else self.keep_in_float32) | set(also)
        while True:
            fixed = models.copy(model, keep)
            # With no dtype changed, the copy computes as the model did:
            # this report is its diagnosis.
            checked = self._diagnose(fixed, **self._arguments) if keep else (
                self)
            first = checked.first_nonfinite_layer
            # The advice names float16 layers only: not a float32 one.
            if first is not None and first not in checked.keep_in_float32:
                raise ValueError(
                    f"the outputs of layer {first!r} of model {model.name!r} "
                    "are not finite on the diagnosed batches even though it "
                    "computes in float32 (NaN or Inf in its weights, or "
                    "values beyond float32's range): no choice of float32 "
                    "layers makes the forward pass finite")
            named = set(checked.keep_in_float32_per_layer if per_layer
                        else checked.keep_in_float32)
            if named <= keep:
                break
            keep |= named
        self._warn_about(fixed, keep)
        # Compiled as `model` was, with a new optimizer and the new loss scale.
        inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        settings = {key: value
                    for key, value in model.get_compile_config().items()
                    if key not in ("optimizer", "loss")}
        with model.distribute_strategy.scope():
            if optimizer is None:
                optimizer = loss_scale_optimizer.LossScaleOptimizer(
                    type(inner).from_config(inner.get_config()),
                    loss_scale=checked.loss_scale())
            fixed.compile(
                optimizer=optimizer,
                loss=model.loss or self._arguments["loss"],
                **models.keras_module(model).saving.deserialize_keras_object(
                    settings))
        if per_layer and not isinstance(fixed, layerwise.LayerwiseModel):
            # Segments where the gradients' magnitudes part, and only there.
            # (A model scaled per layer already is copied with its own
            # segments and factors: they follow its gradients as they are.)
            return layerwise.scale_per_layer(
                fixed, segments=self.gradient_maxima())
        return fixed

    @staticmethod
    def _warn_about(fixed, keep):
        """The warnings `fix` promises (see there)."""
        if keep and not any(layer.compute_dtype == "float16"
                            for _, layer in models.leaf_layers(fixed)):
            warnings.warn(
                f"fix: every layer of model {fixed.name!r} computes in "
                "float32: mixed precision is off (see the report's advice: "
                "mixed_bfloat16 may suit it)", stacklevel=3)
        unsaved = models.unsaved_float32(fixed, keep)
        if unsaved:
            warnings.warn(
                f"fix: layers {sorted(unsaved)} of model {fixed.name!r} "
                "compute in float32, but the config of the layer that holds "
                "them cannot say so: a model rebuilt from a saved copy "
                "computes them as the original did. Save weights, not the "
                "model, or give that layer a dtype policy map "
                "(keras.dtype_policies.DTypePolicyMap)", stacklevel=3)

    def gradient_maxima(self):
        """`{layer path: the largest float32 gradient of its trainable
        variables}` at loss scale 1 (0 where none was measured): where they
        part, `layerwise.scale_per_layer(model, segments=...)` starts a
        segment."""
        maxima = {}
        for row in self._figures["variables"]:
            maxima[row["layer"]] = max(maxima.get(row["layer"], 0.0),
                                       row["gradient_max"] or 0.0)
        return maxima

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
            per_layer_scalable=[
                name for name in self.keep_in_float32
                if name not in self.keep_in_float32_per_layer],
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

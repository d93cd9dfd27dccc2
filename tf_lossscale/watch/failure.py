"""`FailureReport`: a float16 run's persistent failure, its diagnosis on
the weights as they were then, how they moved since a diagnosis before
training, and the files it saves (text, JSON, plot, reproduction bundle)."""

import json
import math
import pathlib
import warnings

import numpy as np

from tf_lossscale import layerwise
from tf_lossscale.diagnosis import advice
from tf_lossscale.diagnosis import carry_on as carry_on_lib
from tf_lossscale.diagnosis import text
from tf_lossscale import groups as group_lib
from tf_lossscale.ops import float16
from tf_lossscale.step import optimizer_protocol


class Float16FailureError(RuntimeError):
    """A watched float16 run failed persistently; `report` holds the
    `FailureReport`, and the message its text."""

    def __init__(self, report):
        super().__init__(str(report))
        self.report = report


class FailureReport:
    """What a `FailureWatch` found when the run failed.

    Attributes: `step` (the step, from 1, at which the failure was noticed),
    `reason` (the trigger, a sentence), `scale`, `settled_scale`,
    `skipped_steps`, `diagnosis` (the `Float16Diagnosis` of the model as it
    was then), `baseline` (the one before training, or None), `cause` (a
    sentence naming the layers), `batches` (those diagnosed).
    """

    def __init__(self, *, step, reason, scale, settled_scale, skipped_steps,
                 diagnosis, baseline, batches, baseline_step=0,
                 fix_horizon=0.25):
        self.step, self.reason = step, reason
        self.baseline_step, self.fix_horizon = baseline_step, fix_horizon
        self.scale, self.settled_scale = scale, settled_scale
        self.skipped_steps = skipped_steps
        self.diagnosis, self.baseline = diagnosis, baseline
        self.batches = batches
        self.cause = self._cause()

    def _cause(self):
        figures = self.diagnosis.as_dict()
        first = figures["first_nonfinite_layer"]
        if figures["input_nonfinite_batches"]:
            return "the inputs hold NaN or Inf"
        if first is not None:
            return (f"the float16 forward pass overflows in layer {first!r}, "
                    "the first whose outputs are not finite")
        if figures["loss_scale_range"] is None:
            return ("the float16 backward pass overflows at every loss "
                    "scale probed")
        if figures["underflowing_variables"]:
            return ("float16 loses the gradients of "
                    f"{', '.join(figures['underflowing_variables'][:5])} to "
                    "underflow" + (
                        "; scaled per layer, float16 keeps them (fix: "
                        "per-layer scaling)" if figures["per_layer_scalable"]
                        else ""))
        if figures["keep_in_float32"]:
            return ("float16 cannot hold layers "
                    f"{', '.join(map(repr, figures['keep_in_float32']))}")
        return ("no layer overflows on the diagnosed batches: the failing "
                "batches may differ from them (pass the data where it failed)")

    def growth(self):
        """`{layer: powers of 2 its largest float32 output grew}` since the
        baseline; {} without one."""
        if self.baseline is None:
            return {}
        before = {row["name"]: row["activation_max_float32"]
                  for row in self.baseline.as_dict()["layers"]}
        return {row["name"]: math.log2(row["activation_max_float32"]
                                       / before[row["name"]])
                for row in self.diagnosis.as_dict()["layers"]
                if before.get(row["name"]) and row["activation_max_float32"]}

    def growing_layers(self):
        """The float16 layers that, growing on as they grew since the
        baseline (powers of 2 per step), would overflow within
        `fix_horizon` times as many steps again; [] without a baseline."""
        grown = self.growth()
        return [row["name"] for row in self.diagnosis.as_dict()["layers"]
                if row["name"] in grown and grown[row["name"]] > 0
                and row["activation_headroom_log2"] is not None
                and row["activation_headroom_log2"] - self.fix_horizon * grown[
                    row["name"]] < advice.ACTIVATION_MARGIN_LOG2]

    def as_dict(self):
        """The report as plain Python values."""
        return {
            "step": self.step, "reason": self.reason, "cause": self.cause,
            "loss_scale": self.scale, "settled_loss_scale": self.settled_scale,
            "skipped_steps": self.skipped_steps,
            "growth_log2": self.growth(),
            "baseline_step": self.baseline_step,
            "growing_layers": self.growing_layers(),
            "diagnosis": self.diagnosis.as_dict(),
            "baseline": (None if self.baseline is None
                         else self.baseline.as_dict()),
        }

    def __str__(self):
        report = self.as_dict()
        diagnosis, grown = report["diagnosis"], report["growth_log2"]
        lines = [f"float16 failure at step {self.step}: {self.reason}.",
                 f"Cause: {self.cause}.",
                 f"Loss scale {self.scale:g} (settled at "
                 f"{text.number(self.settled_scale, 'g')}); "
                 f"{self.skipped_steps} steps skipped in all.",
                 f"Largest float32 outputs of the float16 layers now "
                 f"(float16 holds {float16.FLOAT16_MAX:g})"
                 + (", and powers of 2 grown since before training:"
                    if grown else ":")]
        lines += [f"  {row['name']:<24} "
                  f"{text.number(row['activation_max_float32']):>10}"
                  + (f"  {grown[row['name']]:+.1f}" if row["name"] in grown
                     else "") for row in diagnosis["layers"]
                  if row["compute_dtype"] == "float16"]
        growing = [name for name in report["growing_layers"]
                   if name not in diagnosis["keep_in_float32"]]
        if growing:
            lines.append(
                f"Growing as they grew since step {self.baseline_step}, "
                f"layers {', '.join(map(repr, growing))} would overflow "
                f"within {self.fix_horizon:g} times as many steps again: "
                "fix(model) keeps them in float32 too.")
        lines += ["", "Diagnosis at the failure:", text.render(diagnosis)]
        return "\n".join(lines)

    def fix(self, model, scale=None, optimizers=None, per_layer=None):
        """`model` fixed by the diagnosis, with `growing_layers()` in float32
        too, its optimizer's state carried on
        (`tf_lossscale.diagnosis.carry_on`); `scale` defaults to where the
        scale had settled, or, if it never had, where it began. If
        `model.optimizer` is in a `LossScaleGroup`, `optimizers` lists every
        optimizer of the group, and the return is `(fixed model, their new
        optimizers in that order)`, all in one new group. `per_layer`
        (`Float16Diagnosis.fix`'s) defaults to `per_layer_advised(model)`
        (for a group, only a model scaled per layer already stays so)."""
        if per_layer is None:
            per_layer = self.per_layer_advised(model) and (
                optimizers is None
                or isinstance(model, layerwise.LayerwiseModel))
        if scale is None:
            scale = self.settled_scale or getattr(
                group_lib.underlying(getattr(model.optimizer, "loss_scale",
                                             None)),
                "initial_loss_scale", None)
        return carry_on_lib.carry_on(self.diagnosis, model, scale,
                                     also=self.growing_layers(),
                                     optimizers=optimizers,
                                     per_layer=per_layer)

    def per_layer_advised(self, model):
        """Whether `fix` scales `model` per layer: a model scaled per layer
        already stays so; another (Keras 3) is when the diagnosis keeps
        layers in float32 only for gradients lost to underflow, which a
        scale of their own keeps in float16."""
        if isinstance(model, layerwise.LayerwiseModel):
            return True
        return bool(self.diagnosis.as_dict()["per_layer_scalable"]) and (
            not optimizer_protocol.comes_from_tf_keras(model))

    def save(self, directory, model=None):
        """Writes `report.txt`, `report.json`, `diagnosis.png` (with
        matplotlib, the "plot" extra; skipped without it) and, given
        `model`, a reproduction bundle (`save_bundle`) into `directory`;
        returns its path."""
        path = pathlib.Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / "report.txt").write_text(str(self) + "\n")
        (path / "report.json").write_text(json.dumps(
            _strict(self.as_dict()), indent=1, allow_nan=False))
        try:
            self.diagnosis.plot(path / "diagnosis.png")
        except ImportError:
            pass  # The text says it all; the plot is the "plot" extra's.
        if model is not None:
            try:
                save_bundle(path / "bundle", model, self.batches)
            except (TypeError, ValueError, OSError) as err:
                # The report matters more than its bundle (a custom layer
                # Keras cannot save, batches of nested inputs).
                warnings.warn(f"FailureReport.save: the reproduction bundle "
                              f"could not be saved to {path / 'bundle'}: "
                              f"{err}", stacklevel=2)
        return path


def _strict(value):
    """`value` as strict JSON holds it: non-finite floats as strings
    ("inf", "nan"), numpy scalars as Python ones."""
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def save_bundle(directory, model, batches):
    """Saves `model` (weights, optimizer state, config) and `batches` to
    `directory`: `load_bundle` gives them back, to `diagnose` offline."""
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.save(path / "model.keras")
    arrays = {}
    for index, batch in enumerate(batches):
        for part, value in zip(("x", "y", "w"), batch):
            if value is not None:
                arrays[f"{index}_{part}"] = np.asarray(value)
    np.savez_compressed(path / "batches.npz", **arrays)
    return path


def load_bundle(directory, custom_objects=None):
    """`(model, batches)` saved by `save_bundle`; `tf_lossscale.diagnose(
    model, batches)` shows the failure again."""
    import keras  # pylint: disable=g-import-not-at-top
    path = pathlib.Path(directory)
    if not (path / "model.keras").is_file():
        raise ValueError(f"directory {str(directory)!r} holds no bundle "
                         "(model.keras is missing)")
    model = keras.saving.load_model(path / "model.keras",
                                    custom_objects=custom_objects)
    with np.load(path / "batches.npz") as stored:
        arrays = dict(stored)
    batches = []
    while f"{len(batches)}_x" in arrays:
        batches.append(tuple(arrays.get(f"{len(batches)}_{part}")
                             for part in ("x", "y", "w")))
    return model, batches

"""`diagnose`: why a float16 run fails, measured on a few batches: its
checks, then the passes (`passes.py`), their rows (`rows.py`) and the
report (`report.py`)."""

import itertools

from tf_lossscale.diagnosis import models
from tf_lossscale.diagnosis import passes
from tf_lossscale.diagnosis import progress as progress_lib
from tf_lossscale.diagnosis import report
from tf_lossscale.diagnosis import rows
from tf_lossscale._internal import checks


def diagnose(model, data, steps=8, *, loss=None,
             scales=tuple(2.0 ** k for k in range(33)),
             overflow_tolerance=0.05, underflow_tolerance=0.01,
             training=True, verbose="auto"):
    """Measures where a float16 model overflows and underflows; returns a
    `Float16Diagnosis`.

    Each batch runs in float32 on a twin of the model, then as the model
    computes at each of `scales` (up to the first that overflows), in every
    replica of its strategy, without XLA, dropout and noise layers off.
    Both runs are copies rebuilt from the model's config: the model, its
    optimizer, the dtype policies and Python's and numpy's random states
    are left as they were. Syncs with the host after every pass. What is
    measured, and the rule that judges underflow:
    docs/guides/float16-troubleshooting.md.

    Args:
      model: a functional or Sequential Keras model (Keras 3 or tf-keras),
        nested models and KerasHub tasks included, with one output, as it
        trains (e.g. built under `mixed_float16`).
      data: a `tf.data.Dataset` or any iterable of `(x, y)` or
        `(x, y, sample_weight)` batches, as `fit` takes them.
      steps: how many batches of `data` to run, at most.
      loss: the loss, as `compile` takes it; by default the compiled one.
      scales: the loss scales to probe, > 0, increasing.
      overflow_tolerance: the share of batches (0 to 1) whose backward pass
        may overflow at the top of the advised range (with the default and
        fewer than 20 batches, none).
      underflow_tolerance: the share of a layer's float32 gradient norm (0
        to 1) that underflow may take from one of its variables before the
        variable counts as underflowing; also how much more of it the
        bottom of the advised range may lose than its top.
      training: run the layers as `fit` does (True) or as `predict` does.
      verbose: 0 (silent), 1 (a progress bar), 2 (a line per phase), or
        "auto": 1 in an interactive run, else 2.

    Raises:
      TypeError: a model `diagnose` cannot run (see above), or a batch that
        is not a tuple of 2 or 3.
      ValueError: no batch; a bad `steps`, `scales`, `overflow_tolerance`,
        `underflow_tolerance`, `training` or `verbose`; no loss; or a batch
        that does not split evenly over the replicas.
    """
    arguments = {
        name: checks.finite_float32(name, value, at_least=0, at_most=1)
        for name, value in (("overflow_tolerance", overflow_tolerance),
                            ("underflow_tolerance", underflow_tolerance))}
    steps = checks.positive_int("steps", steps)
    training = checks.boolean("training", training)
    level = progress_lib.check_verbose(verbose)
    try:
        scales = [float(scale) for scale in scales]
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"scales must be numbers, got {checks.summary(scales)}") from err
    if not scales or not all(0 < s < float("inf") for s in scales) or any(
            b <= a for a, b in zip(scales, scales[1:])):
        raise ValueError("scales must be finite numbers > 0 in increasing "
                         f"order, got {checks.summary(scales)}")
    loss, loss_fn = _loss(model, loss)
    batches = []
    for index, batch in enumerate(itertools.islice(iter(data), steps)):
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
            raise TypeError(
                f"batch {index} of data must be (x, y) or (x, y, "
                f"sample_weight), got {checks.summary(batch)}")
        batches.append(tuple(batch) + (None,) * (3 - len(batch)))
    if not batches:
        raise ValueError("data holds no batch")
    arguments.update(data=batches, steps=len(batches), loss=loss,
                     scales=scales, training=training, verbose=verbose)
    progress = progress_lib.Progress(
        level, models.keras_module(model),
        len(batches) * (1 + len(scales)), f"diagnose {model.name!r}")
    runs = passes.Passes(model, loss_fn, training)
    progress.line("rebuilt a float32 twin and a float16 copy")
    figures = rows.figures(runs, batches, scales, progress)
    return report.Float16Diagnosis(figures, arguments, diagnose,
                                   runs.layer_paths)


def _loss(model, loss):
    """The loss as given or compiled, and a function `(y_true, y_pred) ->
    per-example losses`."""
    models.check_model(model)
    identifier = loss if loss is not None else getattr(model, "loss", None)
    if identifier is None:
        raise ValueError(
            f"model {model.name!r} is not compiled with a loss: pass "
            "loss= (a name, a function of (y_true, y_pred) or a Loss)")
    if isinstance(identifier, (dict, list, tuple)):
        raise TypeError(
            f"diagnose takes one loss, got {checks.summary(identifier)}")
    losses = models.keras_module(model).losses
    function = losses.get(identifier)
    # A Loss object reduces its values itself; `call` gives them per
    # example, to be reduced here as the replicas' shares need.
    return identifier, (function.call if isinstance(function, losses.Loss)
                        else function)

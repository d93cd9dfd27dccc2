"""Where a scaled model's segments start: at every layer with weights, in n
groups, at named layers, or where the layers' gradient magnitudes part."""

import collections.abc
import math

import keras

from tf_lossscale._internal import checks

# A segment holds the layers whose largest gradients lie within 2**8 of its
# first layer's: one scale leaves the smallest of them all but 8 of
# float16's 40 binades. A boundary between closer layers costs ops and
# rescues nothing.
PARTING_LOG2 = 8.0

# Layers that start no segment: a normalization's backward pass can make its
# input's gradient much larger than its weights' and the layer before it
# ones; on a boundary between them an overflow there would be blamed on the
# segment below (docs/guides/per-layer-scaling.md, "Limits").
_JOINING = (keras.layers.BatchNormalization, keras.layers.LayerNormalization,
            keras.layers.GroupNormalization)


def segment_layers(units, segments):
    """`{layer name: segment}` for the top-level layers `units` (see
    `scale_per_layer` for `segments`)."""
    weighted = [u.name for u in units
                if u.trainable_weights and not isinstance(u, _JOINING)]
    names = [u.name for u in units]
    if isinstance(segments, str) and segments == "layers":
        starts = weighted[1:]
    elif isinstance(segments, int) and not isinstance(segments, bool):
        count = checks.positive_int("segments", segments)
        if count > len(weighted):
            raise ValueError(
                f"segments={segments} asks for more segments than the "
                f"{len(weighted)} layers with trainable weights")
        starts = [weighted[(i * len(weighted)) // count]
                  for i in range(1, count)]
    elif isinstance(segments, collections.abc.Mapping):
        starts = _parting(weighted, _by_layer(segments, names))
    elif isinstance(segments, (list, tuple)) and all(
            isinstance(name, str) for name in segments):
        _check_names(segments, names)
        starts = list(segments)
    else:
        raise TypeError(
            'segments must be "layers", a positive int, a list of layer '
            "names or a dict of layer names to gradient magnitudes, got "
            f"{checks.summary(segments)}")
    segment_of, index = {}, 0
    for unit in units:
        if unit.name in starts and segment_of:
            index += 1
        segment_of[unit.name] = index
    if index == 0:
        why = ("the layers' largest gradients lie within 2**"
               f"{PARTING_LOG2:.0f} of each other, one loss scale holds "
               "them" if isinstance(segments, collections.abc.Mapping)
               else "nothing to scale per layer")
        raise ValueError(
            f"segments={checks.summary(segments)} makes one segment: {why} "
            "(a LossScaleOptimizer alone does this)")
    return segment_of


def _check_names(given, names):
    unknown = [name for name in given if name not in names]
    if unknown:
        raise ValueError(
            f"segments names no top-level layer of the model: {unknown} "
            f"(its layers: {checks.summary(names)})")


def _by_layer(magnitudes, names):
    """`{top-level layer: largest magnitude}` from `{layer name or path
    ("block/dense"): magnitude}`: a nested model's is its layers' largest."""
    largest = {}
    for path, value in magnitudes.items():
        if value is None:
            continue
        value = checks.finite_float32(f"segments[{path!r}]", value,
                                      at_least=0)
        name = str(path).split("/")[0]
        largest[name] = max(largest.get(name, 0.0), value)
    _check_names(list(largest), names)
    return largest


def _parting(weighted, magnitudes):
    """The layers of `weighted` that start a segment: those whose largest
    gradient parts from the current segment's first by more than 2**8.
    Layers without one (no gradient measured, or 0) join the one before."""
    starts, reference = [], None
    for name in weighted:
        value = magnitudes.get(name, 0.0)
        if value <= 0:
            continue
        if reference is not None and abs(
                math.log2(value / reference)) > PARTING_LOG2:
            starts.append(name)
        if reference is None or name in starts:
            reference = value
    return starts

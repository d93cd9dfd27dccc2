"""Shared helpers for differential tests against TensorFlow's own loss scales.

TensorFlow still ships its reference `tf.compat.v1.mixed_precision`
`DynamicLossScale` and `FixedLossScale`; tf_lossscale promises bit-identical
scales and the same skip decisions. This module builds those oracles, random
gradient structures to feed them, and runners that step several loss scales
side by side in each execution mode (eager, `tf.function`, TF1 graph).

Everything random is drawn from a `numpy.random.Generator` passed in by the
caller, so a failing sequence is reproduced from its seed alone.
"""

import numpy as np
import tensorflow as tf

FLOAT32_MAX = float(np.finfo(np.float32).max)

# Values the parity tests always cover, next to random ones: the float32
# ceiling, scales below the backoff floor of 1, multipliers barely above 1 and
# huge ones, and a period as long as TensorFlow's default.
EXTREME_INITIAL_SCALES = (FLOAT32_MAX / 4, FLOAT32_MAX, 1e-30, 0.5, 1.0,
                          2.0**15)
EXTREME_MULTIPLIERS = (1.5, 1.0001, 3.0, 1e10, 2.0)
EXTREME_PERIODS = (1, 2, 3, 7, 2000)

NON_FINITE_VALUES = (np.nan, np.inf, -np.inf)
GRADIENT_DTYPES = (np.float16, np.float32)


def reference_dynamic(initial_loss_scale=2**15, increment_period=2000,
                      multiplier=2.0):
    """TensorFlow's own `DynamicLossScale`, the oracle."""
    return tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=initial_loss_scale,
        increment_period=increment_period,
        multiplier=multiplier)


def reference_scales(finite_steps, *args, **kwargs):
    """The scale after each step of `reference_dynamic(*args, **kwargs)` fed
    one gradient per step: 1.0 where `finite_steps` is true, else NaN."""
    reference = reference_dynamic(*args, **kwargs)
    scales = []
    for finite in finite_steps:
        reference.update([tf.constant(1.0 if finite else np.nan)])
        scales.append(float(reference()))
    return scales


def reference_fixed(loss_scale_value):
    """TensorFlow's own `FixedLossScale`, the oracle."""
    return tf.compat.v1.mixed_precision.FixedLossScale(loss_scale_value)


def reference_unscale(grad, scale):
    """0.1.0's unscaling, the formula applied weights are pinned to: divide in
    float32 (float64 for float64 gradients), cast back to the gradient's
    dtype."""
    wide = tf.float64 if grad.dtype == tf.float64 else tf.float32
    return tf.cast(tf.cast(grad, wide) / tf.cast(scale, wide), grad.dtype)


def float32_bits(values):
    """The raw float32 bit patterns, so -0.0, NaN payloads and ulps count."""
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def assert_same_float32_bits(actual, expected, context=""):
    actual = np.atleast_1d(np.asarray(actual, dtype=np.float32))
    expected = np.atleast_1d(np.asarray(expected, dtype=np.float32))
    assert actual.shape == expected.shape, (
        f"{context}: {actual.shape} values vs {expected.shape} expected")
    actual_bits, expected_bits = float32_bits(actual), float32_bits(expected)
    mismatches = np.flatnonzero(actual_bits != expected_bits)
    if mismatches.size:
        first = mismatches[0]
        raise AssertionError(
            f"{context}: {mismatches.size} float32 values differ, first at "
            f"step {first}: {actual[first]!r} ({actual_bits[first]:#010x}) "
            f"vs expected {expected[first]!r} "
            f"({expected_bits[first]:#010x})\n"
            f"actual:   {actual.tolist()}\nexpected: {expected.tolist()}")


def assert_same_flags(actual, expected, context=""):
    actual = np.asarray(actual, dtype=bool)
    expected = np.asarray(expected, dtype=bool)
    mismatches = np.flatnonzero(actual != expected)
    if mismatches.size:
        raise AssertionError(
            f"{context}: should_apply_gradients differs at steps "
            f"{mismatches.tolist()}\nactual:   {actual.astype(int).tolist()}"
            f"\nexpected: {expected.astype(int).tolist()}")


# ----------------------------------------------------------------------------
# Random parameters.


def keyed_rng(seed, *key):
    """A generator for one randomized case, keyed by the file's `seed` and the
    case (`key`: integers): a case draws the same values whichever cases run
    before it, or whether they run at all (`pytest -k`)."""
    return np.random.default_rng([seed, *key])


def random_dynamic_params(rng, extreme_probability=0.5):
    """`DynamicLossScale` arguments, each extreme or random."""

    def pick(extremes, draw_random):
        if rng.random() < extreme_probability:
            return extremes[rng.integers(len(extremes))]
        return draw_random()

    def random_initial():
        return min(float(10.0**rng.uniform(-30, 38.6)), FLOAT32_MAX)

    def random_multiplier():
        if rng.random() < 0.5:
            return float(1.0 + 10.0**rng.uniform(-4, 0.5))
        return float(10.0**rng.uniform(0.5, 12))

    return {
        "initial_loss_scale": pick(EXTREME_INITIAL_SCALES, random_initial),
        "increment_period": int(
            pick(EXTREME_PERIODS, lambda: int(rng.integers(1, 13)))),
        "multiplier": pick(EXTREME_MULTIPLIERS, random_multiplier),
    }


def random_finite_pattern(rng, num_steps):
    """Which steps are finite: from all finite to all non-finite."""
    non_finite_rate = (0.0, 0.05, 0.2, 0.5, 0.9, 1.0)[rng.integers(6)]
    return [bool(x) for x in rng.random(num_steps) >= non_finite_rate]


# ----------------------------------------------------------------------------
# Random gradient structures.


class LeafSpec:
    """One gradient slot: a dense tensor or `tf.IndexedSlices`.

    A plain class on purpose: `tf.nest` must treat it as a leaf.
    """

    def __init__(self, dtype, values_shape, indices=None, dense_shape=None):
        self.dtype = np.dtype(dtype)
        self.values_shape = tuple(values_shape)
        self.indices = indices
        self.dense_shape = dense_shape

    @property
    def is_indexed(self):
        return self.indices is not None

    def __repr__(self):
        kind = "IndexedSlices" if self.is_indexed else "Dense"
        return f"{kind}({self.dtype.name}, {list(self.values_shape)})"


def _random_leaf(rng):
    dtype = GRADIENT_DTYPES[rng.integers(len(GRADIENT_DTYPES))]
    if rng.random() < 0.3:
        rows = int(rng.integers(1, 7))
        width = int(rng.integers(1, 5))
        # Empty slices happen, e.g. for an embedding no id of the batch hit.
        num_slices = 0 if rng.random() < 0.1 else int(rng.integers(1, rows + 1))
        indices = rng.integers(0, rows, size=num_slices).astype(np.int64)
        return LeafSpec(dtype, (num_slices, width), indices=indices,
                        dense_shape=np.array([rows, width], np.int64))
    rank = int(rng.integers(0, 4))
    shape = tuple(
        0 if rng.random() < 0.05 else int(rng.integers(1, 5))
        for _ in range(rank))
    return LeafSpec(dtype, shape)


def _random_nest(rng, items, depth):
    if depth < 2 and len(items) > 1 and rng.random() < 0.5:
        cut = int(rng.integers(1, len(items)))
        items = items[:cut] + [_random_nest(rng, items[cut:], depth + 1)]
    kind = rng.integers(3)
    if kind == 0:
        return list(items)
    if kind == 1:
        return tuple(items)
    return {f"var_{i}": item for i, item in enumerate(items)}


def random_template(rng, max_leaves=5):
    """A random nested structure of `LeafSpec`s and `None`s (maybe empty)."""
    # Now and then no gradients at all, which counts as a finite step.
    num_leaves = 0 if rng.random() < 0.05 else int(
        rng.integers(1, max_leaves + 1))
    leaves = [
        None if rng.random() < 0.2 else _random_leaf(rng)
        for _ in range(num_leaves)
    ]
    if len(leaves) == 1 and rng.random() < 0.3:
        return leaves[0]  # A bare tensor (or None) instead of a structure.
    return _random_nest(rng, leaves, depth=0)


def random_template_with_element(rng):
    """Like `random_template`, plus a slot that always has elements.

    For sequences whose non-finite steps must really be non-finite.
    """
    dtype = GRADIENT_DTYPES[rng.integers(len(GRADIENT_DTYPES))]
    return [random_template(rng), LeafSpec(dtype, (3,))]


def template_leaves(template):
    return [spec for spec in tf.nest.flatten(template) if spec is not None]


def random_gradient_values(rng, template, finite):
    """Numpy values for the template's non-None slots.

    Finite values span each dtype's range, subnormals, zeros and -0.0
    included. When `finite` is False one to three elements become NaN, +Inf
    or -Inf, unless the structure has no element at all.
    """
    values = []
    for spec in template_leaves(template):
        limit = float(np.finfo(spec.dtype).max)
        low = -8 if spec.dtype == np.float16 else -45
        magnitude = 10.0**rng.uniform(
            low, np.log10(limit), size=spec.values_shape)
        raw = rng.uniform(-1, 1, size=spec.values_shape) * magnitude
        raw = np.where(rng.random(spec.values_shape) < 0.05, -0.0, raw)
        # np.array, not astype: rank-0 results would be immutable scalars.
        values.append(np.array(np.clip(raw, -limit, limit), spec.dtype))
    candidates = [i for i, value in enumerate(values) if value.size]
    if not finite and candidates:
        for _ in range(int(rng.integers(1, 4))):
            target = values[candidates[rng.integers(len(candidates))]]
            position = int(rng.integers(target.size))
            target.flat[position] = NON_FINITE_VALUES[
                rng.integers(len(NON_FINITE_VALUES))]
        assert not numpy_all_finite(values)
    return values


def numpy_all_finite(values):
    """An independent judgement of the step, to check both implementations."""
    return all(bool(np.isfinite(value).all()) for value in values)


def assemble_gradients(template, tensors):
    """The gradient structure with `tensors` in the template's slots."""
    tensors = iter(tensors)
    flat = []
    for spec in tf.nest.flatten(template):
        if spec is None:
            flat.append(None)
        elif spec.is_indexed:
            flat.append(tf.IndexedSlices(
                next(tensors), tf.constant(spec.indices),
                tf.constant(spec.dense_shape)))
        else:
            flat.append(next(tensors))
    return tf.nest.pack_sequence_as(template, flat)


class Sequence:
    """Steps to feed: per step a template and its numpy gradient values."""

    def __init__(self, params, steps):
        self.params = params
        self.steps = steps

    @property
    def expected_flags(self):
        return [numpy_all_finite(values) for _, values in self.steps]

    def describe(self):
        kinds = "".join(
            "T" if finite else "F" for finite in self.expected_flags)
        return f"params={self.params} steps={kinds}"


def random_sequence(rng, num_steps=None, params=None, fixed_structure=True,
                    pattern=None, template=None):
    """A random sequence; graph modes need `fixed_structure`.

    Args:
      rng: a `numpy.random.Generator`.
      num_steps: the length, unless `pattern` is given.
      params: `DynamicLossScale` arguments to record; random when None.
      fixed_structure: one gradient structure for all steps.
      pattern: which steps are finite; random when None.
      template: the gradient structure; random when None.
    """
    params = params or random_dynamic_params(rng)
    if pattern is None:
        pattern = random_finite_pattern(rng, num_steps)
    template = template if template is not None else random_template(rng)
    steps = []
    for finite in pattern:
        if not fixed_structure:
            template = random_template(rng)
        steps.append((template, random_gradient_values(rng, template, finite)))
    return Sequence(params, steps)


def scalar_sequence(params, pattern):
    """One scalar float32 gradient per step; `pattern` says which are finite."""
    template = LeafSpec(np.float32, ())
    return Sequence(params, [
        (template, [np.float32(1.0 if finite else np.nan)])
        for finite in pattern
    ])


# ----------------------------------------------------------------------------
# Runners: step several loss scales on the same gradients and read every scale
# after every step.


class Run:
    """What a runner saw, per loss scale in the order of the factories.

    Attributes:
      scales: per loss scale, a float32 array of the scale after each step.
      flags: per loss scale, a bool array of `should_apply_gradients`.
      update_ops: per loss scale, the `update_op` of the last `update` call.
      trace_count: how often the step function was traced (tf.function only).
    """

    def __init__(self, scales, flags, update_ops, trace_count=None):
        self.scales = [np.asarray(s, np.float32) for s in scales]
        self.flags = [np.asarray(f, bool) for f in flags]
        self.update_ops = update_ops
        self.trace_count = trace_count


def _flag_value(flag):
    return bool(np.asarray(flag))


def run_eager(factories, sequence):
    loss_scales = [factory() for factory in factories]
    scales = [[] for _ in loss_scales]
    flags = [[] for _ in loss_scales]
    update_ops = [None] * len(loss_scales)
    for template, values in sequence.steps:
        grads = assemble_gradients(
            template, [tf.constant(value) for value in values])
        for i, loss_scale in enumerate(loss_scales):
            update_ops[i], should_apply = loss_scale.update(grads)
            flags[i].append(_flag_value(should_apply))
            scales[i].append(loss_scale().numpy())
    return Run(scales, flags, update_ops)


def _single_template(sequence):
    template = sequence.steps[0][0]
    if any(step_template is not template
           for step_template, _ in sequence.steps):
        raise ValueError("graph modes need one gradient structure per sequence")
    return template


def run_tf_function(factories, sequence):
    """Steps with one `tf.function` that updates every loss scale."""
    return run_tf_function_together([(factories, sequence)])[0]


def run_tf_function_together(runs):
    """`run_tf_function` of each `(factories, sequence)` in `runs`, all
    stepped by one `tf.function` (one trace): the sequences must have one
    length. Each `Run`'s `trace_count` is that function's."""
    templates = [_single_template(sequence) for _, sequence in runs]
    loss_scales = [[factory() for factory in factories]
                   for factories, _ in runs]
    update_ops = [[None] * len(group) for group in loss_scales]

    @tf.function
    def step(tensors):
        flags, scales = [], []
        for j, group in enumerate(loss_scales):
            grads = assemble_gradients(templates[j], tensors[j])
            for i, loss_scale in enumerate(group):
                update_ops[j][i], should_apply = loss_scale.update(grads)
                flags.append(tf.convert_to_tensor(should_apply))
        # Read after every update: automatic control dependencies order each
        # read after the assignments to its variables.
        for group in loss_scales:
            scales.extend(loss_scale() for loss_scale in group)
        return tf.stack(flags), tf.stack(scales)

    flags, scales = [], []
    for steps in zip(*(sequence.steps for _, sequence in runs)):
        step_flags, step_scales = step(
            [[tf.constant(value) for value in values] for _, values in steps])
        flags.append(step_flags.numpy())
        scales.append(step_scales.numpy())
    return _split_runs(loss_scales, scales, flags, update_ops,
                       step.experimental_get_tracing_count())


def _split_runs(loss_scales, scales, flags, update_ops, trace_count=None):
    """One `Run` per group of `loss_scales` from [step, loss scale] rows."""
    scales = np.array(scales, np.float32).T
    flags = np.array(flags, bool).T
    runs, first = [], 0
    for group, ops in zip(loss_scales, update_ops):
        last = first + len(group)
        runs.append(Run(scales[first:last], flags[first:last], ops,
                        trace_count))
        first = last
    return runs


def run_tf1_graph(factories, sequence):
    """Builds the update ops once in a `tf.Graph`, runs them once per step."""
    return run_tf1_graph_together([(factories, sequence)])[0]


def run_tf1_graph_together(runs):
    """`run_tf1_graph` of each `(factories, sequence)` in `runs`, all in one
    graph and `Session`: the sequences must have one length."""
    with tf.Graph().as_default():
        placeholders, loss_scales, updates = [], [], []
        for factories, sequence in runs:
            template = _single_template(sequence)
            leaves = [tf.compat.v1.placeholder(spec.dtype, spec.values_shape)
                      for spec in template_leaves(template)]
            grads = assemble_gradients(template, leaves)
            group = [factory() for factory in factories]
            placeholders.append(leaves)
            loss_scales.append(group)
            updates.append([loss_scale.update(grads) for loss_scale in group])
        update_ops = [[op for op, _ in group] for group in updates]
        flag_tensors = [tf.convert_to_tensor(flag)
                        for group in updates for _, flag in group]
        reads = [loss_scale() for group in loss_scales for loss_scale in group]
        init = tf.compat.v1.global_variables_initializer()
        scales, flags = [], []
        with tf.compat.v1.Session() as session:
            session.run(init)
            for steps in zip(*(sequence.steps for _, sequence in runs)):
                feed = {}
                for leaves, (_, values) in zip(placeholders, steps):
                    feed.update(zip(leaves, values))
                _, step_flags = session.run([update_ops, flag_tensors], feed)
                # A separate run: inside one run the read may precede the
                # assignment.
                scales.append(session.run(reads))
                flags.append(step_flags)
    return _split_runs(loss_scales, scales, flags, update_ops)


RUNNERS = {
    "eager": run_eager,
    "tf_function": run_tf_function,
    "tf1_graph": run_tf1_graph,
}

"""`DynamicLossScale` against TensorFlow's reference implementation.

The promise: for any parameters and any sequence of steps, our
`DynamicLossScale` holds the same float32 scale, bit for bit, as
`tf.compat.v1.mixed_precision.DynamicLossScale` fed the same gradients, and
asks to skip exactly the same steps; eagerly, in a `tf.function` and in a TF1
graph run by a `Session`. (`FixedLossScale` against TensorFlow's:
test_fixed_loss_scale.py; the extended rule against a numpy model:
test_dynamic_rule_against_model.py.)

The randomized sequences are seeded, so every failure names a sequence that
reruns identically. Their total size is in the module constants below.
"""

import functools
import itertools

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import reference_oracle as oracle
import tf_lossscale

SEED = 20_190_501

# Eager sequences: every combination of the extreme parameters, then random
# ones. The gradient structure changes from step to step.
EXTREME_PARAMS = [
    {"initial_loss_scale": initial, "increment_period": period,
     "multiplier": multiplier}
    for initial, period, multiplier in itertools.product(
        oracle.EXTREME_INITIAL_SCALES, oracle.EXTREME_PERIODS,
        oracle.EXTREME_MULTIPLIERS)
]
EAGER_RANDOM_SEQUENCES = 30
EAGER_STEPS = 16

# Graph-mode sequences keep one structure, so one trace serves all steps; all
# sequences of a mode are stepped together, by one tf.function or one graph.
TF_FUNCTION_SEQUENCES = 36
TF_FUNCTION_STEPS = 50
TF1_GRAPH_SEQUENCES = 50
TF1_GRAPH_STEPS = 50

# TensorFlow's default period of 2000 needs long runs to grow at all.
LONG_PARAMS = [
    {"initial_loss_scale": 2.0**15, "increment_period": 2000,
     "multiplier": 2.0},
    {"initial_loss_scale": oracle.FLOAT32_MAX / 4, "increment_period": 2000,
     "multiplier": 1.5},
    {"initial_loss_scale": 1e-30, "increment_period": 2000,
     "multiplier": 1e10},
]
LONG_MODES = ("tf_function", "tf1_graph")
LONG_STEPS = 4100

TOTAL_SEQUENCES = (len(EXTREME_PARAMS) + EAGER_RANDOM_SEQUENCES
                   + TF_FUNCTION_SEQUENCES + TF1_GRAPH_SEQUENCES
                   + len(LONG_PARAMS) * len(LONG_MODES))
TOTAL_COMPARED_STEPS = (
    (len(EXTREME_PARAMS) + EAGER_RANDOM_SEQUENCES) * EAGER_STEPS
    + TF_FUNCTION_SEQUENCES * TF_FUNCTION_STEPS
    + TF1_GRAPH_SEQUENCES * TF1_GRAPH_STEPS
    + len(LONG_PARAMS) * len(LONG_MODES) * LONG_STEPS)

MODES = tuple(oracle.RUNNERS)


def _ours_and_reference(params):
    return [lambda: tf_lossscale.DynamicLossScale(**params),
            lambda: oracle.reference_dynamic(**params)]


def _run_and_assert_parity(mode, sequence):
    run = oracle.RUNNERS[mode](_ours_and_reference(sequence.params), sequence)
    _assert_parity(mode, sequence, run)
    return run


def _assert_parity(mode, sequence, run):
    context = f"{mode}, {sequence.describe()}"
    ours_scales, reference_scales = run.scales
    ours_flags, reference_flags = run.flags
    oracle.assert_same_float32_bits(
        ours_scales, reference_scales, f"scale ({context})")
    oracle.assert_same_flags(ours_flags, reference_flags, context)
    # A third, independent opinion on which steps were finite, so a bug
    # shared with the reference's finiteness check would still show.
    oracle.assert_same_flags(ours_flags, sequence.expected_flags, context)


@functools.lru_cache(maxsize=None)
def _graph_runs(mode):
    """Every random sequence of a graph mode and its `Run`, all stepped
    together (the tests of a mode share one xdist group, so one worker does
    this once)."""
    key, count, steps = {
        "tf_function": (2, TF_FUNCTION_SEQUENCES, TF_FUNCTION_STEPS),
        "tf1_graph": (3, TF1_GRAPH_SEQUENCES, TF1_GRAPH_STEPS)}[mode]
    sequences = [oracle.random_sequence(oracle.keyed_rng(SEED, key, index),
                                        steps) for index in range(count)]
    together = {"tf_function": oracle.run_tf_function_together,
                "tf1_graph": oracle.run_tf1_graph_together}[mode]
    runs = together([(_ours_and_reference(sequence.params), sequence)
                     for sequence in sequences])
    return list(zip(sequences, runs))


def _assert_update_op_type(mode, run):
    update_op = run.update_ops[0]
    if mode == "eager":
        assert update_op is None
    else:
        assert isinstance(update_op, tf.Operation), update_op


class TestRandomizedParity:

    @pytest.mark.parametrize("index", range(len(EXTREME_PARAMS)), ids=[
        "initial={initial_loss_scale:.3g}-period={increment_period}"
        "-multiplier={multiplier:g}".format(**params)
        for params in EXTREME_PARAMS
    ])
    def test_eager_matches_reference_for_extreme_parameters(self, index):
        sequence = oracle.random_sequence(
            oracle.keyed_rng(SEED, 0, index), EAGER_STEPS,
            params=EXTREME_PARAMS[index], fixed_structure=False)
        run = _run_and_assert_parity("eager", sequence)
        _assert_update_op_type("eager", run)

    @pytest.mark.parametrize("index", range(EAGER_RANDOM_SEQUENCES))
    def test_eager_matches_reference_for_random_parameters(self, index):
        sequence = oracle.random_sequence(
            oracle.keyed_rng(SEED, 1, index), EAGER_STEPS,
            fixed_structure=False)
        _run_and_assert_parity("eager", sequence)

    @pytest.mark.xdist_group("parity_tf_function")
    @pytest.mark.parametrize("index", range(TF_FUNCTION_SEQUENCES))
    def test_tf_function_matches_reference(self, index):
        sequence, run = _graph_runs("tf_function")[index]
        _assert_parity("tf_function", sequence, run)
        # The loss scale must not force a retrace per step: its state lives
        # in variables, not in Python values baked into the trace.
        assert run.trace_count == 1
        _assert_update_op_type("tf_function", run)

    @pytest.mark.xdist_group("parity_tf1_graph")
    @pytest.mark.parametrize("index", range(TF1_GRAPH_SEQUENCES))
    def test_tf1_graph_session_matches_reference(self, index):
        sequence, run = _graph_runs("tf1_graph")[index]
        _assert_parity("tf1_graph", sequence, run)
        _assert_update_op_type("tf1_graph", run)

    @pytest.mark.parametrize("mode", LONG_MODES)
    def test_default_length_period_grows_like_reference(self, mode):
        rng = oracle.keyed_rng(SEED, 4, LONG_MODES.index(mode))
        template = oracle.random_template_with_element(rng)
        # One early overflow, then only finite steps: the scales must grow
        # exactly at the 2000th and 4000th good step after it.
        overflow_step = int(rng.integers(0, LONG_STEPS - 4000))
        sequence = oracle.Sequence(None, [
            (template, oracle.random_gradient_values(
                rng, template, finite=step != overflow_step))
            for step in range(LONG_STEPS)
        ])
        # All parameter sets share one run (ours, reference, ours, ...) to
        # pay the per-step overhead once.
        factories = [factory for params in LONG_PARAMS
                     for factory in _ours_and_reference(params)]
        run = oracle.RUNNERS[mode](factories, sequence)
        for i, params in enumerate(LONG_PARAMS):
            context = f"{mode}, {params}, overflow at {overflow_step}"
            ours, reference = run.scales[2 * i:2 * i + 2]
            oracle.assert_same_float32_bits(ours, reference, context)
            oracle.assert_same_flags(run.flags[2 * i], run.flags[2 * i + 1],
                                     context)
            oracle.assert_same_flags(run.flags[2 * i],
                                     sequence.expected_flags, context)
            assert len(set(ours.tolist())) >= 3, (
                f"{context}: growth never happened; the test lost its point")


# TensorFlow's own published expectations (initial 1, period 2, multiplier 2
# unless said); scale read after every step, T finite, F non-finite.
TRACE_TABLE = {
    "grows_once_per_period": ((1.0, 2, 2.0), "TTTTTT", [1, 2, 2, 4, 4, 8]),
    "backs_off_then_floors_at_one": (
        (16.0, 2, 2.0), "FFFFFF", [8, 4, 2, 1, 1, 1]),
    "overflow_restarts_the_period": ((1.0, 2, 2.0), "TTTFT", [1, 2, 2, 1, 1]),
    "period_one_grows_every_step": (
        (1.0, 1, 2.0), "TTTFTT", [2, 4, 8, 4, 8, 16]),
    "multiplier_three": ((4.0, 2, 3.0), "TTFTT", [4, 12, 4, 4, 12]),
    "saturates_at_float32_max": (
        (oracle.FLOAT32_MAX / 4, 1, 2.0), "TTTT",
        [oracle.FLOAT32_MAX / 2] + [oracle.FLOAT32_MAX] * 3),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(TRACE_TABLE))
def test_published_traces_hold_for_ours_and_reference(mode, case):
    (initial, period, multiplier), pattern, expected = TRACE_TABLE[case]
    params = {"initial_loss_scale": initial, "increment_period": period,
              "multiplier": multiplier}
    finite = [step == "T" for step in pattern]
    run = oracle.RUNNERS[mode](
        _ours_and_reference(params), oracle.scalar_sequence(params, finite))
    for name, scales, flags in zip(("ours", "reference"), run.scales,
                                   run.flags):
        oracle.assert_same_float32_bits(scales, expected, f"{name} {case}")
        oracle.assert_same_flags(flags, finite, f"{name} {case}")


def _run_side_by_side(mode, param_sets, pattern):
    """Runs ours and the reference for every parameter set in one go.

    Yields `(params, ours_scales)` after checking parity and flags.
    """
    factories = [factory for params in param_sets
                 for factory in _ours_and_reference(params)]
    run = oracle.RUNNERS[mode](
        factories, oracle.scalar_sequence(None, pattern))
    for i, params in enumerate(param_sets):
        ours, reference = run.scales[2 * i:2 * i + 2]
        oracle.assert_same_float32_bits(ours, reference, f"{mode} {params}")
        oracle.assert_same_flags(run.flags[2 * i], pattern, f"{mode} {params}")
        yield params, ours


@pytest.mark.parametrize("mode", MODES)
def test_growth_never_overflows_to_inf(mode):
    param_sets = [
        {"initial_loss_scale": initial, "increment_period": 1,
         "multiplier": multiplier}
        for initial, multiplier in itertools.product(
            [oracle.FLOAT32_MAX, oracle.FLOAT32_MAX / 4,
             oracle.FLOAT32_MAX / 1.5, 1e30],
            [2.0, 1.0001, 3.0, 1e10])
    ]
    pattern = [True] * 12 + [False, True]
    for params, ours in _run_side_by_side(mode, param_sets, pattern):
        assert np.isfinite(ours).all(), (params, ours)
        assert (np.diff(ours[:12]) >= 0).all(), (params, ours)
        if params["initial_loss_scale"] == oracle.FLOAT32_MAX:
            assert (ours[:12] == np.float32(oracle.FLOAT32_MAX)).all(), (
                params, ours)


@pytest.mark.parametrize("mode", MODES)
def test_backoff_never_goes_below_one(mode):
    param_sets = [
        {"initial_loss_scale": initial, "increment_period": 2,
         "multiplier": multiplier}
        for initial, multiplier in itertools.product(
            [1e-30, 0.5, 1.0, 3.0, 2.0**15], [2.0, 1e10, 1.5])
    ]
    for params, ours in _run_side_by_side(mode, param_sets, [False] * 30):
        assert (ours >= 1).all(), (params, ours)
        # Even a scale that started below 1 is lifted to the floor.
        assert ours[-1] == 1, (params, ours)

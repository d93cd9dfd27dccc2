"""DynamicLossScale's extended rule against an independent numpy model.

`dynamic_rule_model.RuleModel` states the rule (floor, ceiling, back-off
factor, hysteresis, failure policy) in plain numpy float32 arithmetic. Here
the implementation is fed the same random finite/non-finite sequences, for
many random parameter sets, eagerly, in a `tf.function` and in a TF1 graph run
by a `Session`, and must hold the same state bit for bit after every step:
the scale S, the good steps G and, where they exist, the hysteresis budget H
and the consecutive skips C. Where the model says a step fails ("raise" at
the floor, `max_consecutive_skips`), the implementation must fail on exactly
that step, after recording it.

Sequences are seeded: a failure names the seed of a sequence that reruns
identically. A few hand-worked traces pin the rule down in readable form.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import dynamic_rule_model as model_lib
from tests.helpers import reference_oracle as oracle
import tf_lossscale

SEED = 20_240_909
NON_FINITE = (np.nan, np.inf, -np.inf)

# Sequences that never fail are run in batches: one tf.function or TF1 graph
# steps every loss scale of the batch, so one trace serves them all.
BATCH_SIZE = 32
BATCH_STEPS = 40
# Sequences with failure policies need a trace each: fewer, shorter.
FAILING_SEQUENCES = 8
FAILING_STEPS = 30

MODES = ("eager", "tf_function", "tf1_graph")


def _gradient_value(rng, finite):
    return 1.0 if finite else NON_FINITE[rng.integers(len(NON_FINITE))]


def _state_variables(loss_scale):
    """S, G, H, C variables (None where absent), by name.

    In a TF1 graph a second loss scale's names get suffixes (`good_steps_1`).
    """
    by_name = {re.sub(r"(_\d+)?:\d+$", "", v.name): v
               for v in loss_scale.variables}
    return [by_name.get(name) for name in (
        "current_loss_scale", "good_steps", "hysteresis_remaining",
        "consecutive_skips")]


def _model_state(model, loss_scale):
    """The model's (S, G, H, C), with H and C only where the object has them."""
    scale, good_steps, budget, skips = model.state()
    _, _, budget_variable, skips_variable = _state_variables(loss_scale)
    return (scale, good_steps,
            None if budget_variable is None else budget,
            None if skips_variable is None else skips)


def _assert_same_state(actual, expected, context):
    oracle.assert_same_float32_bits(actual[0], expected[0], f"S, {context}")
    assert actual[1:] == expected[1:], (
        f"(G, H, C) {actual[1:]} != model's {expected[1:]}, {context}")


class _Batch:
    """Loss scales and their models, each with its own random sequence."""

    def __init__(self, rng, policies):
        self.arguments = [model_lib.random_rule_arguments(rng, policies)
                          for _ in range(BATCH_SIZE)]
        # The last one keeps every default: TensorFlow's rule.
        self.arguments[-1] = {"initial_loss_scale": 4.0,
                              "increment_period": 2, "multiplier": 2.0}
        self.values = np.array(
            [[_gradient_value(rng, finite)
              for finite in model_lib.random_pattern(rng, BATCH_STEPS)]
             for _ in self.arguments], np.float32).T  # [step, loss scale]

    def make_loss_scales(self):
        return [tf_lossscale.DynamicLossScale(**args)
                for args in self.arguments]

    def expected(self, mode):
        """Per step and loss scale, the model's (S, G, H, C) and flag."""
        models = [model_lib.RuleModel(**args, graph=mode != "eager")
                  for args in self.arguments]
        states, flags = [], []
        for row in self.values:
            for model, value in zip(models, row):
                assert model.step(bool(np.isfinite(value))) is None
            states.append([model.state() for model in models])
            flags.append(np.isfinite(row).tolist())
        return states, flags


def _read_all(loss_scales):
    return [tuple(None if v is None else v.numpy()
                  for v in _state_variables(ls)) for ls in loss_scales]


def _run_batch_eager(batch):
    loss_scales = batch.make_loss_scales()
    states, flags = [], []
    for row in batch.values:
        step_flags = []
        for loss_scale, value in zip(loss_scales, row):
            update_op, should_apply = loss_scale.update([tf.constant(value)])
            assert update_op is None
            step_flags.append(bool(should_apply))
        flags.append(step_flags)
        states.append(_read_all(loss_scales))
    return loss_scales, states, flags


def _run_batch_tf_function(batch):
    loss_scales = batch.make_loss_scales()

    @tf.function
    def step(values):
        flags = []
        for index, loss_scale in enumerate(loss_scales):
            update_op, should_apply = loss_scale.update([values[index]])
            assert isinstance(update_op, tf.Operation)
            flags.append(should_apply)
        # Automatic control dependencies order each read after the updates.
        return tf.stack(flags), [
            tuple(None if v is None else v.read_value()
                  for v in _state_variables(ls)) for ls in loss_scales]

    states, flags = [], []
    for row in batch.values:
        step_flags, state = step(tf.constant(row))
        flags.append(step_flags.numpy().tolist())
        states.append([tuple(None if v is None else v.numpy() for v in vs)
                       for vs in state])
    assert step.experimental_get_tracing_count() == 1
    return loss_scales, states, flags


def _run_batch_tf1_graph(batch):
    with tf.Graph().as_default():
        values = tf.compat.v1.placeholder(tf.float32, [BATCH_SIZE])
        loss_scales = batch.make_loss_scales()
        updates = [ls.update([values[i]]) for i, ls in enumerate(loss_scales)]
        assert all(isinstance(op, tf.Operation) for op, _ in updates)
        flag_tensor = tf.stack([flag for _, flag in updates])
        variables = [_state_variables(ls) for ls in loss_scales]
        reads = [[v for v in vs if v is not None] for vs in variables]
        states, flags = [], []
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for row in batch.values:
                _, step_flags = session.run(
                    [[op for op, _ in updates], flag_tensor], {values: row})
                flags.append(step_flags.tolist())
                # A separate run: inside one run a read may precede a write.
                read = iter(session.run(reads))
                step_state = []
                for vs in variables:
                    got = iter(next(read))
                    step_state.append(tuple(
                        None if v is None else next(got) for v in vs))
                states.append(step_state)
    return loss_scales, states, flags


_BATCH_RUNNERS = {
    "eager": _run_batch_eager,
    "tf_function": _run_batch_tf_function,
    "tf1_graph": _run_batch_tf1_graph,
}


@pytest.mark.parametrize("policies", [("continue",), ("continue", "warn")],
                         ids=["continue", "continue_or_warn"])
@pytest.mark.parametrize("mode", MODES)
def test_random_rules_match_the_model_step_by_step(mode, policies):
    batch = _Batch(
        oracle.keyed_rng(SEED, 0, MODES.index(mode), len(policies)), policies)
    for args in batch.arguments:
        args.pop("max_consecutive_skips", None)
    loss_scales, states, flags = _BATCH_RUNNERS[mode](batch)
    expected_states, expected_flags = batch.expected(mode)
    for step, (step_states, step_expected) in enumerate(
            zip(states, expected_states)):
        for index, (actual, expected) in enumerate(
                zip(step_states, step_expected)):
            has = [v is not None for v in actual]
            expected = tuple(e if h else None for e, h in zip(expected, has))
            _assert_same_state(
                actual, expected,
                f"{mode}, step {step}, arguments {batch.arguments[index]}, "
                f"gradients {batch.values[:step + 1, index].tolist()}")
    assert flags == expected_flags
    # Only the features asked for add state.
    for loss_scale, args in zip(loss_scales, batch.arguments):
        _, _, budget, skips = _state_variables(loss_scale)
        assert (budget is not None) == (args.get("hysteresis", 1) > 1)
        assert (skips is not None) == (
            args.get("on_min_loss_scale", "continue") != "continue")


def _failing_arguments(rng):
    """Arguments that make some sequences fail: a low floor, short limits."""
    args = model_lib.random_rule_arguments(rng, ("continue", "warn", "raise"))
    if args["on_min_loss_scale"] != "raise" and rng.random() < 0.7:
        args["max_consecutive_skips"] = int(rng.integers(2, 6))
    if rng.random() < 0.5:
        args["min_loss_scale"] = args["initial_loss_scale"] / 8
    return args


def _failing_sequence(rng):
    args = _failing_arguments(rng)
    pattern = model_lib.random_pattern(rng, FAILING_STEPS // 2) + [False] * (
        FAILING_STEPS // 2)
    values = [_gradient_value(rng, finite) for finite in pattern]
    return args, values


def _expected_until_failure(args, values, mode="eager"):
    """The model's states up to and including the failing step, and the
    failure's kind (None if the sequence never fails)."""
    model = model_lib.RuleModel(**args, graph=mode != "eager")
    states = []
    for value in values:
        failure = model.step(bool(np.isfinite(value)))
        states.append(model.state())
        if failure:
            return states, failure
    return states, None


def _stepper(mode, loss_scale_args):
    """(loss_scale, step(value) -> should_apply, read() -> state, cleanup)."""
    if mode == "eager":
        loss_scale = tf_lossscale.DynamicLossScale(**loss_scale_args)
        return (loss_scale,
                lambda v: bool(loss_scale.update([tf.constant(v)])[1]),
                lambda: tuple(None if x is None else x.numpy()
                              for x in _state_variables(loss_scale)),
                lambda: None)
    if mode == "tf_function":
        loss_scale = tf_lossscale.DynamicLossScale(**loss_scale_args)
        function = tf.function(
            lambda v: loss_scale.update([v])[1])
        return (loss_scale, lambda v: bool(function(tf.constant(v))),
                lambda: tuple(None if x is None else x.numpy()
                              for x in _state_variables(loss_scale)),
                lambda: None)
    graph = tf.Graph()
    with graph.as_default():
        value = tf.compat.v1.placeholder(tf.float32, [])
        loss_scale = tf_lossscale.DynamicLossScale(**loss_scale_args)
        update_op, should_apply = loss_scale.update([value])
        variables = _state_variables(loss_scale)
        session = tf.compat.v1.Session()
        session.run(tf.compat.v1.global_variables_initializer())

    def step(v):
        return bool(session.run([update_op, should_apply], {value: v})[1])

    def read():
        got = iter(session.run([x for x in variables if x is not None]))
        return tuple(None if x is None else next(got) for x in variables)

    return loss_scale, step, read, session.close


_FAILURE_WORDS = {"raise": "on_min_loss_scale=raise",
                  "max_consecutive_skips": "max_consecutive_skips="}


@pytest.mark.parametrize("index", range(FAILING_SEQUENCES))
@pytest.mark.parametrize("mode", MODES)
def test_random_rules_fail_exactly_where_the_model_fails(mode, index):
    args, values = _failing_sequence(oracle.keyed_rng(SEED, 1, index))
    expected_states, expected_failure = _expected_until_failure(
        args, values, mode)
    loss_scale, step, read, cleanup = _stepper(mode, args)
    failure = None
    try:
        for number, value in enumerate(values[:len(expected_states)]):
            try:
                should_apply = step(value)
            except tf.errors.InvalidArgumentError as error:
                failure = (number, str(error))
                break
            assert should_apply == bool(np.isfinite(value))
            expected = _model_state(
                _model_at(args, values, number + 1, mode), loss_scale)
            _assert_same_state(read(), expected,
                               f"{mode}, step {number}, {args}, {values}")
        if expected_failure is None:
            assert failure is None, failure
            return
        assert failure is not None, (
            f"expected {expected_failure} at step {len(expected_states) - 1}"
            f", {args}, {values}")
        number, message = failure
        assert number == len(expected_states) - 1, message
        assert _FAILURE_WORDS[expected_failure] in message, message
        # The failing step was recorded (skipped) before the failure.
        _assert_same_state(
            read(), _model_state(_model_at(args, values, number + 1, mode),
                                 loss_scale),
            f"{mode}, state after failing step {number}, {args}")
    finally:
        cleanup()


def _model_at(args, values, num_steps, mode):
    model = model_lib.RuleModel(**args, graph=mode != "eager")
    for value in values[:num_steps]:
        model.step(bool(np.isfinite(value)))
    return model


def test_failing_sequences_cover_both_failures_and_a_clean_run():
    # Guards that the seeded sequences above exercise what they claim.
    failures = {
        _expected_until_failure(
            *_failing_sequence(oracle.keyed_rng(SEED, 1, i)))[1]
        for i in range(FAILING_SEQUENCES)}
    assert {"raise", "max_consecutive_skips"} <= failures


# ---------------------------------------------------------------------------
# Hand-worked traces: S after each step (T finite, F not).

T, F = True, False

_TRACES = {
    # Two non-finite steps before each back-off; the budget refills when the
    # scale grows, not on a finite step.
    "hysteresis_two": (
        dict(initial_loss_scale=8, increment_period=2, hysteresis=2),
        [F, T, F, F, T, T, F, F],
        [8, 8, 4, 2, 2, 4, 4, 2]),
    # With consecutive_hysteresis every finite step refills the budget, so
    # isolated overflows never back off.
    "consecutive_hysteresis": (
        dict(initial_loss_scale=8, increment_period=3, hysteresis=2,
             consecutive_hysteresis=True),
        [F, T, F, T, F, F, F],
        [8, 8, 8, 8, 8, 4, 2]),
    "backoff_factor_and_floor_below_one": (
        dict(initial_loss_scale=1, increment_period=1, multiplier=2,
             backoff_factor=0.25, min_loss_scale=2.0**-6),
        [F, F, F, F, T, T],
        [0.25, 2.0**-4, 2.0**-6, 2.0**-6, 2.0**-5, 2.0**-4]),
    "ceiling_clamps_growth": (
        dict(initial_loss_scale=4, increment_period=1, multiplier=3,
             max_loss_scale=20),
        [T, T, T, F, T],
        [12, 20, 20, 20.0 / 3, 20]),
    "default_floor_lifts_a_small_initial_scale_as_tf_does": (
        dict(initial_loss_scale=0.5, increment_period=2),
        [F, T, T],
        [1, 1, 2]),
}


@pytest.mark.parametrize("name", _TRACES)
def test_hand_worked_traces(name):
    args, pattern, expected = _TRACES[name]
    loss_scale = tf_lossscale.DynamicLossScale(**args)
    model = model_lib.RuleModel(**args)
    scales = []
    for finite in pattern:
        loss_scale.update([tf.constant(1.0 if finite else np.nan)])
        model.step(finite)
        scales.append(float(loss_scale()))
        assert float(loss_scale()) == float(model.scale)
    np.testing.assert_array_equal(np.float32(scales), np.float32(expected))


def test_backoff_factor_none_divides_like_tf_while_a_factor_multiplies():
    # 1/3 is not exact in float32: S / 3 and S * float32(1/3) differ.
    divided = tf_lossscale.DynamicLossScale(initial_loss_scale=10.0,
                                            multiplier=3.0)
    multiplied = tf_lossscale.DynamicLossScale(
        initial_loss_scale=10.0, multiplier=3.0, backoff_factor=1 / 3)
    reference = oracle.reference_dynamic(initial_loss_scale=10.0,
                                         multiplier=3.0)
    for loss_scale in (divided, multiplied, reference):
        loss_scale.update([tf.constant(np.nan)])
    assert divided().numpy() == np.float32(10.0) / np.float32(3.0)
    assert multiplied().numpy() == np.float32(10.0) * np.float32(1 / 3)
    assert divided().numpy() != multiplied().numpy()
    oracle.assert_same_float32_bits(divided().numpy(), reference().numpy())


@pytest.mark.parametrize("mode", ["eager", "tf_function"])
def test_explicit_default_arguments_are_tf_reference_bit_for_bit(mode):
    rng = oracle.keyed_rng(SEED, 2, ("eager", "tf_function").index(mode))
    params = {"initial_loss_scale": 3.0e5, "increment_period": 3,
              "multiplier": 1.7}
    explicit = dict(params, backoff_factor=None, min_loss_scale=1.0,
                    max_loss_scale=None, hysteresis=1,
                    consecutive_hysteresis=False,
                    on_min_loss_scale="continue", max_consecutive_skips=None)
    sequence = oracle.scalar_sequence(params,
                                      model_lib.random_pattern(rng, 80))
    run = oracle.RUNNERS[mode](
        [lambda: tf_lossscale.DynamicLossScale(**explicit),
         lambda: oracle.reference_dynamic(**params)], sequence)
    oracle.assert_same_float32_bits(run.scales[0], run.scales[1], mode)
    oracle.assert_same_flags(run.flags[0], run.flags[1], mode)
    created = tf_lossscale.DynamicLossScale(**explicit)
    assert [v.name for v in created.variables] == [
        "current_loss_scale:0", "good_steps:0"]
    assert created.get_config() == oracle.reference_dynamic(
        **params).get_config()

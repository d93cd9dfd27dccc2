"""The factor rule of per-layer scaling (`tf_lossscale.layerwise.rule`)
against an independent numpy model of its specification, step by step."""

import numpy as np
import pytest
import tensorflow as tf

from tf_lossscale.layerwise import rule as rule_lib

F32 = np.float32


class RuleModel:
    """The rule as its docstring specifies it, in numpy float32, one segment
    at a time (written from the specification, not from the code)."""

    def __init__(self, lower, period=3, min_factor=2.0**-40,
                 max_factor=2.0**40):
        self.factors = np.ones(lower, F32)
        self.margins = np.ones(lower, F32)
        self.good = np.zeros(lower, np.int64)
        self.period = period
        self.low, self.high = F32(min_factor), F32(max_factor)

    def step(self, nonfinite, informed, top_measured, log2_ratio):
        """Returns S's flag."""
        lower = len(self.factors)
        bad = [k for k in range(lower + 1) if nonfinite[k]]
        blamed = max(bad) if bad else -1
        all_finite = not bad
        top_flag = not nonfinite[lower]
        for k in range(lower):
            alignment = self.factors[k] / self.margins[k]
            margin = self.margins[k]
            if k >= blamed:  # Learned something this step.
                if k == blamed:
                    at_floor = margin <= F32(rule_lib.MIN_MARGIN)
                    if at_floor or self.factors[k] <= max(self.low, F32(1)):
                        # Not scaled above the top, or at its floor: S
                        # backs off, the segment's margin is kept.
                        top_flag = False
                    else:
                        margin = max(margin / F32(2),
                                     F32(rule_lib.MIN_MARGIN))
                        self.good[k] = 0
                elif self.good[k] + 1 >= self.period:
                    margin = min(margin * F32(2), F32(1))
                    self.good[k] = 0
                else:
                    self.good[k] += 1
            if all_finite:
                if informed[k]:
                    alignment = F32(2.0 ** np.floor(log2_ratio[k]))
                elif top_measured:
                    alignment = alignment * F32(2.0**8)
            self.margins[k] = margin
            self.factors[k] = np.clip(alignment * margin, self.low, self.high)
        return top_flag


def _step(rule, state, figures):
    new, top_flag = rule_lib.next_factor_state(
        rule_lib.FactorState(*(tf.constant(v) for v in state)),
        rule_lib.Figures(*(tf.constant(v) for v in figures)), rule)
    return [v.numpy() for v in new], bool(top_flag)


# Each step: nonfinite (3 segments, the top last), informed, top measured,
# log2(u_top / u_k) of the two lower segments.
_OK = (False, False, False)
_SCENARIOS = {
    "aligns_then_climbs_without_figures": [
        (_OK, (True, True), True, (12.7, -3.2)),
        (_OK, (False, True), True, (0.0, 5.0)),
        (_OK, (False, False), False, (0.0, 0.0)),
    ],
    "blames_the_highest_non_finite_segment": [
        (_OK, (True, True), True, (20.0, 10.0)),
        ((True, True, False), (False, False), False, (0.0, 0.0)),
        ((True, False, False), (False, False), False, (0.0, 0.0)),
        (_OK, (True, True), True, (20.0, 10.0)),
    ],
    "the_top_overflowing_keeps_every_factor": [
        (_OK, (True, True), True, (3.0, 2.0)),
        ((True, True, True), (False, False), False, (0.0, 0.0)),
        (_OK, (True, True), True, (3.0, 2.0)),
    ],
    "margins_grow_back_after_the_period": [
        (_OK, (True, True), True, (4.0, 4.0)),
        ((False, True, False), (False, False), False, (0.0, 0.0)),
        ((False, True, False), (False, False), False, (0.0, 0.0)),
    ] + [(_OK, (True, True), True, (4.0, 4.0))] * 8,
    # Segment 1 starts 2**12 above the top: 12 halvings of its margin bring
    # it level, then S backs off for it.
    "a_segment_not_above_the_top_hands_the_back_off_to_s": [
        (_OK, (True, True), True, (20.0, 12.0))] + [
            ((False, True, False), (False, False), False, (0.0, 0.0))] * 30,
    "a_segment_at_scale_1_hands_the_back_off_to_s_at_once": [
        ((False, True, False), (False, False), False, (0.0, 0.0))] * 3,
}


@pytest.mark.parametrize("name", sorted(_SCENARIOS))
def test_rule_matches_its_specification_step_by_step(name):
    rule = rule_lib.checked_rule(increment_period=3, min_factor=2.0**-20,
                                 max_factor=2.0**16)
    model = RuleModel(2, period=3, min_factor=2.0**-20, max_factor=2.0**16)
    state = [model.factors.copy(), model.margins.copy(), model.good.copy()]
    for step in _SCENARIOS[name]:
        nonfinite, informed, top_measured, log2_ratio = step
        figures = (np.array(nonfinite), np.array(informed),
                   np.array(top_measured), np.array(log2_ratio, F32))
        state, top_flag = _step(rule, state, figures)
        expected_flag = model.step(nonfinite, informed, top_measured,
                                   log2_ratio)
        assert top_flag == expected_flag, step
        for got, expected in zip(state, (model.factors, model.margins,
                                         model.good)):
            np.testing.assert_array_equal(got, expected, err_msg=str(step))


def test_with_both_bounds_one_every_factor_stays_one_and_s_sees_every_skip():
    rule = rule_lib.checked_rule(min_factor=1, max_factor=1)
    state = [np.ones(2, F32), np.ones(2, F32), np.zeros(2, np.int64)]
    for nonfinite in [(False, False, False), (True, False, False),
                      (False, True, False), (False, False, True)]:
        state, top_flag = _step(rule, state, (
            np.array(nonfinite), np.array([True, True]), np.array(True),
            np.array([7.0, -9.0], F32)))
        np.testing.assert_array_equal(state[0], [1.0, 1.0])
        assert top_flag == (not any(nonfinite))


@pytest.mark.parametrize("arguments, message", [
    ({"increment_period": 0}, "increment_period"),
    ({"min_factor": 0.0}, "min_factor"),
    ({"max_factor": float("inf")}, "max_factor"),
    ({"min_factor": 4.0, "max_factor": 2.0}, "max_factor must be >="),
])
def test_bad_rule_arguments_are_refused_by_name(arguments, message):
    with pytest.raises((TypeError, ValueError), match=message):
        rule_lib.checked_rule(**arguments)

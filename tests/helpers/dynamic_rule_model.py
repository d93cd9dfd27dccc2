"""An independent model of the dynamic loss-scale rule, in numpy float32.

Written from the rule as specified (below, and in `DynamicLossScale`'s
docstring), not from tf_lossscale's code, so that differential tests compare
two implementations of one specification:

* finite step: C = 0; if consecutive_hysteresis: H = hysteresis. If
  G + 1 >= increment_period: S = min(S * multiplier, max_loss_scale) if
  S * multiplier is finite (else S is unchanged), G = 0, H = hysteresis.
  Otherwise G = G + 1.
* non-finite step: G = 0, C = C + 1, H = max(H - 1, 0). If H == 0 a back-off
  is due: S = max(S * backoff_factor (or S / multiplier), min_loss_scale);
  if S was already <= min_loss_scale, the on_min_loss_scale policy acts.
  Then, if C >= max_consecutive_skips, the step fails.

Every float operation is one numpy float32 operation, as TensorFlow does it.
One TensorFlow detail is modelled on purpose: in graphs (`tf.function`, TF1
sessions) Grappler's constant folding rewrites `x / constant` into
`x * (1 / constant)`, so there TensorFlow's own rule, and therefore
tf_lossscale's with `backoff_factor=None`, backs off by multiplying with the
float32 reciprocal of the multiplier; eagerly it divides. `graph=True` selects
the graph arithmetic.
"""

import numpy as np

F32 = np.float32
FLOAT32_MAX = float(np.finfo(np.float32).max)


class RuleModel:
    """The state of one dynamic loss scale and its step function.

    Attributes:
      scale, good_steps, hysteresis_left, skips_in_a_row: S, G, H, C.
      warned: whether the last step printed the at-the-floor warning.
    """

    def __init__(self, initial_loss_scale=2**15, increment_period=2000,
                 multiplier=2.0, backoff_factor=None, min_loss_scale=1.0,
                 max_loss_scale=None, hysteresis=1,
                 consecutive_hysteresis=False, on_min_loss_scale="continue",
                 max_consecutive_skips=None, graph=False):
        self.period = int(increment_period)
        self.multiplier = F32(multiplier)
        self.backoff_factor = (None if backoff_factor is None
                               else F32(backoff_factor))
        self.floor = F32(min_loss_scale)
        self.ceiling = None if max_loss_scale is None else F32(max_loss_scale)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.policy = on_min_loss_scale
        self.max_skips = max_consecutive_skips
        self.graph = graph
        self.scale = F32(initial_loss_scale)
        self.good_steps = 0
        self.hysteresis_left = self.hysteresis
        self.skips_in_a_row = 0
        self.warned = False

    def step(self, finite):
        """Applies one step; returns how it fails: None (it does not),
        "raise" (at the floor) or "max_consecutive_skips"."""
        self.warned = False
        with np.errstate(over="ignore"):
            if finite:
                return self._finite_step()
            return self._non_finite_step()

    def _finite_step(self):
        self.skips_in_a_row = 0
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.good_steps + 1 >= self.period:
            grown = self.scale * self.multiplier
            if np.isfinite(grown):
                if self.ceiling is not None and grown > self.ceiling:
                    grown = self.ceiling
                self.scale = grown
            self.good_steps = 0
            self.hysteresis_left = self.hysteresis
        else:
            self.good_steps += 1
        return None

    def _non_finite_step(self):
        self.good_steps = 0
        self.skips_in_a_row += 1
        self.hysteresis_left = max(self.hysteresis_left - 1, 0)
        failure = None
        if self.hysteresis_left == 0:
            already_at_floor = self.scale <= self.floor
            if self.backoff_factor is None and self.graph:
                smaller = self.scale * (F32(1) / self.multiplier)
            elif self.backoff_factor is None:
                smaller = self.scale / self.multiplier
            else:
                smaller = self.scale * self.backoff_factor
            self.scale = smaller if smaller > self.floor else self.floor
            if already_at_floor and self.policy == "warn":
                self.warned = True
            if already_at_floor and self.policy == "raise":
                failure = "raise"
        if failure is None and self.max_skips is not None and (
                self.skips_in_a_row >= self.max_skips):
            failure = "max_consecutive_skips"
        return failure

    def state(self):
        return (F32(self.scale), self.good_steps, self.hysteresis_left,
                self.skips_in_a_row)


def random_rule_arguments(rng, policies=("continue",)):
    """Random `DynamicLossScale` keyword arguments, extremes included.

    The floor, ceiling and initial scale are drawn so they are consistent,
    at times equal to each other, below 1 or near the float32 limits.
    """

    def log_uniform(low, high):
        return float(10.0**rng.uniform(low, high))

    initial = [2.0**15, 1.0, 0.5, FLOAT32_MAX / 4, 1e-30,
               log_uniform(-6, 6)][rng.integers(6)]
    args = {"initial_loss_scale": initial,
            "increment_period": int(rng.integers(1, 6)),
            "multiplier": [2.0, 3.0, 1.5, 1.0001, 1e10,
                           float(1 + log_uniform(-3, 1))][rng.integers(6)]}
    if rng.random() < 0.6:
        args["backoff_factor"] = [0.5, 0.25, 0.9, 1 / 3, 1e-6,
                                  float(rng.uniform(0.01, 0.99))][
                                      rng.integers(6)]
    if rng.random() < 0.6:
        # Explicit floors must not exceed the initial scale.
        args["min_loss_scale"] = [
            initial, initial / 64, min(initial, 2.0**-24),
            initial * float(rng.uniform(0.001, 1))][rng.integers(4)]
    floor = args.get("min_loss_scale", 1.0)
    if rng.random() < 0.5:
        lowest = max(float(F32(initial)), float(F32(floor)))
        args["max_loss_scale"] = [
            lowest, min(lowest * 16, FLOAT32_MAX), FLOAT32_MAX,
            min(lowest * float(rng.uniform(1, 1000)), FLOAT32_MAX)][
                rng.integers(4)]
    if rng.random() < 0.6:
        args["hysteresis"] = int(rng.integers(1, 5))
    if rng.random() < 0.5:
        args["consecutive_hysteresis"] = bool(rng.random() < 0.5)
    args["on_min_loss_scale"] = policies[rng.integers(len(policies))]
    if rng.random() < 0.4:
        args["max_consecutive_skips"] = int(rng.integers(1, 8))
    return args


def random_pattern(rng, num_steps):
    """Finite (True) or not per step, in runs so hysteresis is exercised."""
    rate = (0.05, 0.2, 0.4, 0.6, 0.9)[rng.integers(5)]
    pattern = []
    while len(pattern) < num_steps:
        finite = bool(rng.random() >= rate)
        pattern.extend([finite] * int(rng.integers(1, 5)))
    return pattern[:num_steps]

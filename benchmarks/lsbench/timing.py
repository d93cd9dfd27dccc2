"""Timing candidates side by side, so that load hits them alike.

The machine is shared and noisy: absolute times mean little. Candidates run
in interleaved rounds (each round runs every candidate once, in turn) and
only medians of ratios measured within one process are reported.
"""

import statistics
import time


def interleaved(candidates, rounds, calls):
    """Wall time of each candidate in interleaved rounds.

    Args:
      candidates: name -> callable; each is called once first, outside the
        measurement (tracing, warm-up).
      rounds: how many rounds.
      calls: calls per candidate per round.

    Returns:
      name -> list of seconds per call, one per round.
    """
    for fn in candidates.values():
        fn()
    samples = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls)
    return samples


def medians(samples):
    return {name: statistics.median(values) for name, values in samples.items()}


def median_ratios(samples, baseline):
    """name -> median over rounds of (that round's time / the baseline's)."""
    return {name: statistics.median(
        value / base for value, base in zip(values, samples[baseline]))
            for name, values in samples.items()}

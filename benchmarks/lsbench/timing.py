"""Timing candidates side by side, so that load hits them alike.

The machine is shared and noisy: absolute times mean little. Candidates run
in interleaved rounds (each round runs every candidate once, in turn) and
only medians of ratios measured within one process are reported.
"""

import statistics
import time
from typing import NamedTuple


class Samples(NamedTuple):
    """name -> seconds per call, one per round, in process CPU time (all
    threads) and in wall time."""
    cpu: dict
    wall: dict


def interleaved(candidates, rounds, calls):
    """Times each candidate in interleaved rounds.

    Args:
      candidates: name -> callable; each is called once first, outside the
        measurement (tracing, warm-up).
      rounds: how many rounds.
      calls: calls per candidate per round.

    Returns:
      `Samples`. CPU time is the figure to trust on a loaded machine: it
      leaves out the time other processes hold the cores.
    """
    for fn in candidates.values():
        fn()
    samples = Samples({name: [] for name in candidates},
                      {name: [] for name in candidates})
    for _ in range(rounds):
        for name, fn in candidates.items():
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            samples.cpu[name].append((time.process_time() - cpu) / calls)
            samples.wall[name].append((time.perf_counter() - wall) / calls)
    return samples


def median_ratios(samples, baseline):
    """name -> median over rounds of (that round's time / the baseline's)."""
    return {name: statistics.median(
        value / base for value, base in zip(values, samples[baseline]))
            for name, values in samples.items()}

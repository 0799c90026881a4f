"""Timing for the package's measured decisions (the engine's plan, the dLLM plan, the benches). A leaf module.

The drafter's remote code (`models/dscale/assistant.py`) keeps a copy of `median_seconds` for the throughput cut
of `assistant_model=`, because it ships alone in a model folder and imports nothing of the package."""

from __future__ import annotations

import time


def median_seconds(jobs: dict, repeats: int = 3, clock=time.perf_counter, sync=lambda: None) -> dict:
    """{key: median seconds of `jobs[key]()`} over `repeats` rounds that run every job in turn, so a slow spell of
    the machine hits all of them alike and a single outlier is outvoted."""
    seconds: dict = {key: [] for key in jobs}
    for _ in range(repeats):
        for key, job in jobs.items():
            sync()
            start = clock()
            job()
            sync()
            seconds[key].append(clock() - start)
    return {key: sorted(s)[len(s) // 2] for key, s in seconds.items()}

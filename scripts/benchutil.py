"""Shared by the benchmark scripts: side-by-side timing in one process."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def time_interleaved(fns: Sequence[Callable[[], object]], warmup: int, repeats: int) -> list[list[float]]:
    """Alternates the candidates run by run, so machine noise hits all of them alike; seconds per run."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return times

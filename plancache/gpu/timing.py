"""CUDA-event timing: warm-up, then the median of repeated runs."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms(run: Callable[[], None], *, warmup: int = 3, repeats: int = 20, budget_s: float | None = 0.25) -> float:
    """Median milliseconds of ``run()`` on the current stream, each run bracketed by CUDA events.

    With ``budget_s`` a slow ``run`` gets fewer repeats (never fewer than 3)."""
    return statistics.median(timings_ms(run, warmup=warmup, repeats=repeats, budget_s=budget_s))


def timings_ms(run: Callable[[], None], *, warmup: int = 3, repeats: int = 20, budget_s: float | None = 0.25) -> list[float]:
    """Every timed run's milliseconds (see :func:`median_ms`)."""
    stream = torch.cuda.current_stream()
    for _ in range(warmup):
        run()
    n = repeats
    if budget_s is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        n = max(3, min(repeats, int(budget_s * 1000 / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        s.record(stream)
        run()
        e.record(stream)
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]

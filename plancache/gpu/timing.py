"""CUDA-event timing: warm-up, then the median of repeated runs.

A cuDNN ``execute`` costs tens of microseconds of host time, so back-to-back launches of a
kernel shorter than that measure the host, not the GPU. Runs shorter than ``graph_below_ms``
are therefore timed by replaying a CUDA graph that holds several of them; longer runs (where
launch overhead is noise) and runs that cannot be captured are timed eagerly.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

SetStream = Callable[[int], None]

#: A run of at least ``graph_below_ms`` taking this many times the best median so far, once after a warm-up,
#: cannot win (one eager run is a noisy figure: the margin is wide).
EAGER_GIVE_UP = 2.0
#: A short run whose first timed replay of its CUDA graph (about 1 ms of back-to-back runs, launches excluded)
#: takes this many times the best median so far per run cannot win.
REPLAY_GIVE_UP = 1.25


def median_ms(run: Callable[[], None], *, warmup: int = 3, repeats: int = 20, budget_s: float | None = 0.25,
              set_stream: SetStream | None = None, graph_below_ms: float = 0.5,
              best_ms: float | None = None) -> float:
    """Median milliseconds of one ``run()`` (see :func:`timings_ms`)."""
    return statistics.median(timings_ms(run, warmup=warmup, repeats=repeats, budget_s=budget_s,
                                        set_stream=set_stream, graph_below_ms=graph_below_ms,
                                        best_ms=best_ms))


def timings_ms(run: Callable[[], None], *, warmup: int = 3, repeats: int = 20, budget_s: float | None = 0.25,
               set_stream: SetStream | None = None, graph_below_ms: float = 0.5,
               best_ms: float | None = None) -> list[float]:
    """Milliseconds of each timed ``run()`` on the current stream of the current device, bracketed by CUDA events
(every stream, event and synchronization here is on that device).

    With ``budget_s`` a slow ``run`` gets fewer repeats (never fewer than 3). With ``set_stream``
    (called with a stream id to point the caller's cuDNN handle at it; pass ``lambda s: None`` for
    plain torch work) runs shorter than ``graph_below_ms`` are timed by CUDA-graph replay. With ``best_ms``
    (the best median among the runs this one competes with), a run that cannot win is timed no further and its
    one timing is returned: one of at least ``graph_below_ms`` (where launch overhead is noise) taking
    :data:`EAGER_GIVE_UP` times ``best_ms`` after one warm-up, a shorter one taking :data:`REPLAY_GIVE_UP` times
    it in one replay of its CUDA graph. A short run that cannot be captured is never given up: one eager timing
    of it measures the launch, not the GPU."""
    stream = torch.cuda.current_stream()
    for _ in range(min(warmup, 1)):
        run()
    if best_ms is not None:
        once = _once_ms(run, stream)
        if once >= max(graph_below_ms, best_ms * EAGER_GIVE_UP):
            return [once]
    for _ in range(warmup - 1):
        run()
    first = _once_ms(run, stream)
    if set_stream is not None and first < graph_below_ms:
        try:
            return _graph_timings(run, stream, set_stream, first, repeats, budget_s, best_ms)
        except Exception as exc:  # noqa: BLE001 - not capturable: time it eagerly
            log.info("CUDA-graph timing unavailable (%s); timing eagerly", exc)
    n = repeats if budget_s is None else max(3, min(repeats, int(budget_s * 1000 / max(first, 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        s.record(stream)
        run()
        e.record(stream)
    torch.cuda.synchronize(stream.device)
    return [s.elapsed_time(e) for s, e in events]


def _once_ms(run: Callable[[], None], stream: torch.cuda.Stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    run()
    end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end))


def _graph_timings(run: Callable[[], None], caller: torch.cuda.Stream, set_stream: SetStream, first_ms: float,
                   repeats: int, budget_s: float | None, best_ms: float | None = None) -> list[float]:
    """Per-run milliseconds from replays of a CUDA graph holding ``per`` runs (about 1 ms of work); after a
    warm-up replay, a first replay of :data:`REPLAY_GIVE_UP` times ``best_ms`` per run or more is the only one."""
    per = max(2, min(50, int(1.0 / max(first_ms, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device=caller.device)
    side.wait_stream(caller)
    set_stream(side.cuda_stream)  # before capture: no cuDNN stream call happens while capturing
    try:
        with torch.cuda.graph(graph, stream=side):
            for _ in range(per):
                run()
    finally:
        set_stream(caller.cuda_stream)
    caller.wait_stream(side)
    graph.replay()
    if best_ms is not None:
        once = _once_ms(graph.replay, caller) / per
        if once >= best_ms * REPLAY_GIVE_UP:
            return [once]
    n = repeats if budget_s is None else max(3, min(repeats, int(budget_s * 1000 / max(first_ms * per, 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        s.record(caller)
        graph.replay()
        e.record(caller)
    torch.cuda.synchronize(caller.device)
    return [s.elapsed_time(e) / per for s, e in events]

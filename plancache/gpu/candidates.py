"""Candidate plans of a graph, each built and serialized on its own: in this process, or in a pool of
builder processes while the tuning process times the ones already built.

cuDNN plan builds are CPU work that does not overlap on threads (``bench/results/parallel_build.json``)
and most of tuning time. A :class:`BuildPool` builds candidates in spawned processes, each holding its
own cuDNN handle and the prepared graph of the spec it is working on; a built candidate travels back as
its serialized plan (``serialize`` holds the plan built last), which the tuning process deserializes and
times. Only the tuning process runs anything on the GPU, so no two timings overlap, and the timed plan is
the very blob that is published.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..canonical import canonical_json
from ..procpool import Crashed, OrderedPool
from ..spec import GraphSpec, parse_spec
from .runtime import plan_identity, prepare

#: Most builder processes a default pool starts (beyond this, timing on the one GPU is the bottleneck).
MAX_DEFAULT_PROCESSES = 16


@dataclass(frozen=True)
class BuiltCandidate:
    """One candidate plan, built and serialized (``blob``), or the reason it was not (``error``)."""

    index: int
    engine_id: int | None
    knobs: dict[str, int]
    name: str
    blob: bytes | None
    workspace_bytes: int
    build_seconds: float
    error: str | None = None


def default_processes() -> int:
    """Builder processes for this host: all cores but 4 (the timing process and the system), at least half of
    them, at most :data:`MAX_DEFAULT_PROCESSES` (16 cores: 12); 0 (build in the tuning process) below 4 cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if cores < 4 else min(MAX_DEFAULT_PROCESSES, max(cores - 4, cores // 2))


def build_serialized(graph: Any, index: int) -> BuiltCandidate:
    """Build candidate ``index`` of a prepared graph and serialize it; a candidate cuDNN declines is data."""
    engine_id, knobs, name = plan_identity(graph, index)
    t0 = time.perf_counter()
    try:
        graph.build_plan_at_index(index)
        workspace = int(graph.get_workspace_size_plan_at_index(index))
        blob = bytes(graph.serialize(as_bytes=True))
    except Exception as exc:  # noqa: BLE001 - the backend's refusal is the candidate's outcome
        return BuiltCandidate(index, engine_id, knobs, name, None, 0, time.perf_counter() - t0, str(exc)[:4000])
    return BuiltCandidate(index, engine_id, knobs, name, blob, workspace, time.perf_counter() - t0)


def build_in_process(graph: Any, indices: list[int]) -> Iterator[BuiltCandidate]:
    """Build ``indices`` of ``graph`` one after another, as they are consumed."""
    return (build_serialized(graph, i) for i in indices)


# ---------------------------------------------------------------- inside a builder process

_state: dict[str, Any] = {}


def _init_builder(device: int) -> None:
    import cudnn
    import torch

    torch.cuda.set_device(device)
    _state.update(handle=cudnn.create_handle(), key=None, graph=None)


def _build_task(task: tuple[str, str, int, tuple[int | None, tuple[tuple[str, int], ...]]]) -> BuiltCandidate:
    """Build one candidate in a builder process; the spec's graph is prepared once per process and spec."""
    from .fegraph import decode

    key, document, index, identity = task
    if _state["key"] != key:
        spec = parse_spec(document)
        graph = decode(spec, handle=_state["handle"])
        prepare(graph, spec, list(spec.tuning.heuristic_modes))
        _state.update(key=key, graph=graph)
    graph = _state["graph"]
    engine_id, knobs, name = plan_identity(graph, index)
    if (engine_id, tuple(sorted(knobs.items()))) != identity:
        return BuiltCandidate(index, engine_id, knobs, name, None, 0, 0.0,
                              f"builder process listed a different plan at index {index} "
                              f"(engine {engine_id} {knobs}, expected {identity})")
    return build_serialized(graph, index)


# ---------------------------------------------------------------- the tuning process's side

class BuildPool:
    """``processes`` builder processes on CUDA ``device``, started on first use and kept for later graphs."""

    def __init__(self, processes: int, *, device: int = 0) -> None:
        self.processes = processes
        self._pool = OrderedPool(processes, initializer=_init_builder, initargs=(device,))
        self._pool.start()  # every builder sets up (CUDA, cuDNN handle) while the first graph is prepared

    def build(self, spec: GraphSpec, graph: Any, indices: list[int]) -> Iterator[BuiltCandidate]:
        """Submit every candidate now; yield them in ``indices`` order as they are built. ``graph`` is the
        tuning process's own prepared graph of ``spec`` (canonical), whose plan list the builders must match."""
        document = canonical_json(spec.to_json())
        key = hashlib.sha256(document.encode()).hexdigest()
        tasks = []
        for i in indices:
            engine_id, knobs, _ = plan_identity(graph, i)
            tasks.append((key, document, i, (engine_id, tuple(sorted(knobs.items())))))
        return self._collect(self._pool.map_ordered(_build_task, tasks))

    @staticmethod
    def _collect(results: Iterator[BuiltCandidate | Crashed[Any]]) -> Iterator[BuiltCandidate]:
        for r in results:
            if isinstance(r, Crashed):
                _, _, index, (engine_id, knobs) = r.item
                yield BuiltCandidate(index, engine_id, dict(knobs), "", None, 0, 0.0,
                                     "building this candidate killed its builder process twice (native crash)")
            else:
                yield r

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> BuildPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Candidate plans of a graph, each built and serialized on its own: in this process, or in a pool of
builder processes while the tuning process times the ones already built.

cuDNN plan builds are CPU work that does not overlap on threads (``bench/results/parallel_build.json``)
and most of tuning time. A :class:`BuildPool` builds candidates in spawned processes, each holding its
own cuDNN handle and the prepared graph of the spec it is working on; a built candidate travels back as
its serialized plan (``serialize`` holds the plan built last), which the tuning process deserializes and
times. Only the tuning process runs anything on the GPU, so no two timings overlap, and the timed plan is
the very blob that is published.

Builds are queued first in, first out, so a graph's builds may be submitted while the graph before it is still
being timed (:meth:`BuildPool.ahead`): the builders then never wait for the timing, nor the timing for them.
A build that runs longer than the pool's ``build_timeout`` (a hung compile) has its builder process killed and
replaced; the candidate is reported as not built ("build timed out after N s") and the others go on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from cudnn.engines.engine_ids import is_python_engine

from ..canonical import canonical_json
from ..environment import device_selector
from ..procpool import Crashed, OrderedPool, TimedOut
from ..settings import DEFAULT_BUILD_TIMEOUT
from ..spec import GraphSpec, parse_spec
from .runtime import create_handle, plan_identity, prepare, require_gpu

log = logging.getLogger(__name__)

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


#: Where Linux mounts the process's cgroup (v2: ``cpu.max``; v1: ``cpu/cpu.cfs_quota_us`` and ``cpu.cfs_period_us``).
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota(root: Path | None = None) -> int | None:
    """The CPUs the process's cgroup (under ``root``, default :data:`CGROUP_ROOT`) may use, rounded up (a
    container's CPU limit: Kubernetes' ``resources.limits.cpu``); None without a limit or where none can be read."""
    root = CGROUP_ROOT if root is None else root
    try:
        quota, _, period = (root / "cpu.max").read_text().partition(" ")  # v2: "800000 100000" or "max 100000"
    except OSError:
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text()  # v1: -1 without a limit
            period = (root / "cpu" / "cpu.cfs_period_us").read_text()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max"
        return None
    return max(1, -(-q // p)) if q > 0 and p > 0 else None


def usable_cores() -> int:
    """The CPU cores this process may run on: those its affinity allows, at most its cgroup's CPU limit
    (:func:`cpu_quota`; a pod limited to 8 CPUs on a 128-core node builds with 8, not 128)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    return cores if quota is None else min(cores, quota)


def default_processes(cores: int | None = None) -> int:
    """Builder processes for ``cores`` CPU cores (default: :func:`usable_cores`): all but 4 (the timing process and
    the system), at least half of them, at most :data:`MAX_DEFAULT_PROCESSES` (16 cores: 12); 0 (build in the tuning
    process) below 4 cores. Workers sharing a host each size for their share of its cores."""
    if cores is None:
        cores = usable_cores()
    return 0 if cores < 4 else min(MAX_DEFAULT_PROCESSES, max(cores - 4, cores // 2))


#: Why a python-engine candidate is recorded unbuilt (FE 1.32 offers them by default for some SDPA and norm graphs).
PYTHON_ENGINE_REFUSED = ("not built: a python-engine (CuTe DSL) plan; FE serializes it as CUDNN_FE_PYPLAN, which loads "
                         "only into an empty pygraph, never into the caller's graph that the client and the hook load into")


def build_serialized(graph: Any, index: int) -> BuiltCandidate:
    """Build candidate ``index`` of a prepared graph and serialize it; a candidate cuDNN declines is data, and so is
    a python-engine candidate, never built (:data:`PYTHON_ENGINE_REFUSED`)."""
    engine_id, knobs, name = plan_identity(graph, index)
    if engine_id is not None and is_python_engine(engine_id):
        return BuiltCandidate(index, engine_id, knobs, name, None, 0, 0.0, PYTHON_ENGINE_REFUSED)
    t0 = time.perf_counter()
    try:
        graph.build_plan_at_index(index)
        workspace = int(graph.get_workspace_size_plan_at_index(index))
        blob = bytes(graph.serialize(as_bytes=True))
    except Exception as exc:  # noqa: BLE001 - the backend's refusal is the candidate's outcome
        return BuiltCandidate(index, engine_id, knobs, name, None, 0, time.perf_counter() - t0, str(exc)[:4000])
    return BuiltCandidate(index, engine_id, knobs, name, blob, workspace, time.perf_counter() - t0)


@dataclass
class CandidateSet:
    """A spec's prepared graph, the indices of its distinct candidate plans, and their builds (yielded in order)."""

    graph: Any
    indices: list[int]
    built: Generator[BuiltCandidate, None, None]

    def close(self) -> None:
        """Cancel the builds not started yet (a tuning that stopped early)."""
        self.built.close()


def distinct_candidates(graph: Any, count: int) -> list[int]:
    """Indices of distinct (engine_id, knobs) configs, first occurrence kept (modes A, B, FALLBACK overlap)."""
    seen, keep = set(), []
    for i in range(count):
        eid, knobs, name = plan_identity(graph, i)
        ident = (eid, tuple(sorted(knobs.items()))) if eid is not None else ("name", name, i)
        if ident not in seen:
            seen.add(ident)
            keep.append(i)
    return keep


def list_candidates(spec: GraphSpec, handle: Any) -> tuple[Any, list[int]]:
    """``spec`` (canonical) decoded and prepared on ``handle``, and the indices of its distinct candidates."""
    from .fegraph import decode

    graph = decode(spec, handle=handle)
    prepare(graph, spec, list(spec.tuning.heuristic_modes))
    return graph, distinct_candidates(graph, graph.get_execution_plan_count())


def build_in_process(graph: Any, indices: list[int]) -> Generator[BuiltCandidate, None, None]:
    """Build ``indices`` of ``graph`` one after another, as they are consumed."""
    return (build_serialized(graph, i) for i in indices)


def _document_key(spec: GraphSpec) -> tuple[str, str]:
    """The sha256 of ``spec``'s canonical JSON, and that JSON (what builders are sent)."""
    document = canonical_json(spec.to_json())
    return hashlib.sha256(document.encode()).hexdigest(), document


# ---------------------------------------------------------------- inside a builder process

_state: dict[str, Any] = {}


def _init_builder(uuid: str) -> None:
    """Set up a builder process, which sees one device, ``cuda:0`` (:func:`builder_environ`); it must be the
    device of the tuning process (``uuid``), or this raises and the pool does not start."""
    import torch

    seen = str(torch.cuda.get_device_properties(0).uuid)
    if torch.cuda.device_count() != 1 or seen != uuid:
        raise RuntimeError(f"builder process pinned to the wrong device: it sees {torch.cuda.device_count()} "
                           f"device(s), cuda:0 {seen}, not the tuning device {uuid} alone")
    _state.update(handle=create_handle(0), key=None, graph=None)


def builder_environ(device: int) -> dict[str, str]:
    """The environment that pins a builder process to ordinal ``device`` of this process.

    A builder is started with ``CUDA_VISIBLE_DEVICES`` naming that one device (:func:`~plancache.environment.
    device_selector`: this process's own entry for it, so a renumbering by this process's ``CUDA_VISIBLE_DEVICES``
    is followed), set before CUDA starts in it. Then no call in it, not FE's, cuDNN's or a library's reaching for
    the current or first device, can touch another GPU, and no CUDA context is made on another: a stronger pin
    than ``torch.cuda.set_device``, which moves only the calls that follow the current device. Its initializer
    checks the device it sees by UUID."""
    return {"CUDA_VISIBLE_DEVICES": device_selector(device)}


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
    """``processes`` builder processes on CUDA ``device``, started on first use and kept for later graphs; a build
    may take ``build_timeout`` seconds before its process is killed (``PLANCACHE_BUILD_TIMEOUT``). Each builder
    sees that device alone (:func:`builder_environ`)."""

    def __init__(self, processes: int, *, device: int = 0, build_timeout: float = DEFAULT_BUILD_TIMEOUT) -> None:
        self.processes = processes
        self.device = device
        uuid = str(torch.cuda.get_device_properties(require_gpu(device)).uuid)
        self._pool = OrderedPool(processes, initializer=_init_builder, initargs=(uuid,), task_timeout=build_timeout,
                                 environ=builder_environ(device))
        self._pool.start()  # every builder sets up (CUDA, cuDNN handle) while the first graph is prepared
        self._ahead: dict[str, CandidateSet] = {}
        self._handle: Any = None

    def ahead(self, spec: GraphSpec) -> bool:
        """Prepare ``spec`` (canonical) here and queue its builds now, behind those already queued, for a later
        :meth:`take` (the next graph's builds run while this one is timed). One graph is ahead at a time: one
        queued earlier and not taken is cancelled. False, logged, when it cannot be prepared: its tuning will
        meet the error itself."""
        key = _document_key(spec)[0]
        if key in self._ahead:
            return True
        self._cancel_ahead()
        try:
            if self._handle is None:
                self._handle = create_handle(self.device)
            graph, indices = list_candidates(spec, self._handle)
        except Exception as exc:  # noqa: BLE001 - only a head start; autotune reports the error properly
            log.info("not building %s ahead: %s", spec.name or key[:12], exc)
            return False
        self._ahead[key] = CandidateSet(graph, indices, self.build(spec, graph, indices))
        return True

    def take(self, spec: GraphSpec) -> CandidateSet | None:
        """The candidates queued by :meth:`ahead` for ``spec``, if any (each set is taken once)."""
        return self._ahead.pop(_document_key(spec)[0], None)

    def _cancel_ahead(self) -> None:
        for ahead in self._ahead.values():
            ahead.close()
        self._ahead.clear()

    def build(self, spec: GraphSpec, graph: Any, indices: list[int]) -> Generator[BuiltCandidate, None, None]:
        """Submit every candidate now; yield them in ``indices`` order as they are built. ``graph`` is the
        tuning process's own prepared graph of ``spec`` (canonical), whose plan list the builders must match."""
        key, document = _document_key(spec)
        tasks = []
        for i in indices:
            engine_id, knobs, _ = plan_identity(graph, i)
            tasks.append((key, document, i, (engine_id, tuple(sorted(knobs.items())))))
        return self._collect(self._pool.map_ordered(_build_task, tasks))

    @staticmethod
    def _collect(results: Generator[BuiltCandidate | Crashed[Any] | TimedOut[Any], None, None],
                 ) -> Generator[BuiltCandidate, None, None]:
        try:
            for r in results:
                if isinstance(r, Crashed):
                    _, _, index, (engine_id, knobs) = r.item
                    yield BuiltCandidate(index, engine_id, dict(knobs), "", None, 0, 0.0,
                                         "building this candidate killed its builder process twice (native crash)")
                elif isinstance(r, TimedOut):
                    _, _, index, (engine_id, knobs) = r.item
                    yield BuiltCandidate(index, engine_id, dict(knobs), "", None, 0, r.seconds,
                                         f"build timed out after {r.seconds:g} s (its builder process was killed)")
                else:
                    yield r
        finally:  # closed early: the tasks not started are cancelled
            results.close()

    def close(self) -> None:
        self._cancel_ahead()
        self._pool.close()

    def __enter__(self) -> BuildPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

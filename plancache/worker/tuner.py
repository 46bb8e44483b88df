"""The GPU step of the worker behind a small protocol, so the job loop can run without a GPU in tests."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from ..environment import Environment
from ..protocol import Candidate, PlanMeta
from ..settings import DEFAULT_BUILD_TIMEOUT
from ..spec import GraphSpec

if TYPE_CHECKING:
    from ..gpu import TunedPlan


class TunedResult(Protocol):
    """What the worker needs from a tuning result (:class:`plancache.gpu.TunedPlan` provides it)."""

    blob: bytes
    sha256: str
    environment: Environment
    max_abs_err: float
    tuning_seconds: float
    winner_median_ms: float
    heuristic_median_ms: float | None
    candidates: list[Candidate]  # every candidate tried; the upload carries CandidateTable.best_of them

    def to_meta(self, graph_key: str, worker_id: str) -> PlanMeta: ...


class Tuner(Protocol):
    """Detects the environment, refuses oversized specs, autotunes, and re-checks a serialized plan."""

    def environment(self) -> Environment: ...

    def check_memory(self, spec: GraphSpec) -> int:
        """Bytes ``spec`` needs; raise :class:`~plancache.errors.InsufficientGpuMemory` before allocating."""
        ...

    def tune(self, spec: GraphSpec, *, following: GraphSpec | None = None,
             cancel: threading.Event | None = None) -> TunedResult:
        """Autotune ``spec``; the winner has already matched the reference in this process. ``following``: the spec
        to be tuned next, whose work may start meanwhile. ``cancel``: once set, stop soon (raising), as the result
        is no longer wanted."""
        ...

    def pipelines(self) -> bool:
        """Whether a ``following`` spec is worth claiming ahead (its work overlaps the current tuning)."""
        ...

    def verify(self, spec: GraphSpec, blob: bytes) -> float:
        """Deserialize ``blob``, run it, compare with the reference; return the error or raise ``TuningError``."""
        ...


class GpuTuner:
    """:class:`Tuner` on CUDA device ``device`` through :mod:`plancache.gpu` (imported on first use).

    ``build_processes`` builder processes build candidate plans while this process times them (0: build
    here, one after another; None: :func:`plancache.gpu.candidates.default_processes`). They start with
    the first tuning and stop on :meth:`close`; a build that takes longer than ``build_timeout`` seconds has its
    process killed and its candidate recorded as not built (builds in this process are not bounded)."""

    def __init__(self, device: int = 0, *, warmup: int = 3, repeats: int = 20, build_processes: int | None = None,
                 build_timeout: float = DEFAULT_BUILD_TIMEOUT) -> None:
        if build_processes is not None and build_processes < 0:
            raise ValueError(f"build_processes must be 0 or more, got {build_processes}")
        self.device = device
        self.warmup = warmup
        self.repeats = repeats
        self.build_processes = build_processes
        self.build_timeout = build_timeout
        self._builders: Any = None

    def environment(self) -> Environment:
        from ..environment import detect

        return detect(self.device)

    def check_memory(self, spec: GraphSpec) -> int:
        from .. import gpu

        return gpu.check_memory(spec, device=self.device)

    def tune(self, spec: GraphSpec, *, following: GraphSpec | None = None,
             cancel: threading.Event | None = None) -> TunedPlan:
        from .. import gpu
        from ..gpu.candidates import BuildPool

        if self.pipelines() and self._builders is None:
            self._builders = BuildPool(self._processes(), device=self.device, build_timeout=self.build_timeout)
        return gpu.autotune(spec, device=self.device, warmup=self.warmup, repeats=self.repeats, builders=self._builders,
                            following=following, cancel=cancel)

    def pipelines(self) -> bool:
        """True with builder processes: the next graph's candidates are built while this one is timed."""
        return self._processes() > 0

    def _processes(self) -> int:
        if self.build_processes is None:
            from ..gpu.candidates import default_processes

            self.build_processes = default_processes()
        return self.build_processes

    def verify(self, spec: GraphSpec, blob: bytes) -> float:
        from .. import gpu

        return gpu.verify_plan(spec, blob, device=self.device)

    def close(self) -> None:
        """Stop the builder processes (they start again if :meth:`tune` is called later)."""
        if self._builders is not None:
            self._builders.close()
            self._builders = None

    def __enter__(self) -> GpuTuner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Autotune a spec: build every candidate plan, time it, check its numerics, keep the fastest correct one."""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import cudnn
import torch

from ..digest import Digested
from ..environment import Environment, detect
from ..errors import TuningError
from ..protocol import Candidate, PlanMeta
from ..spec import GraphSpec
from ..validation import MAX_ERROR
from . import native, reference
from .candidates import BuildPool, CandidateSet, build_in_process, list_candidates
from .fegraph import graph_layouts
from .runtime import (
    canonical,
    check_memory,
    check_pack,
    create_handle,
    deserialize_plan,
    expected_outputs,
    require_gpu,
)
from .timing import median_ms

#: Time budget for timing one candidate; slow candidates get fewer repeats (never fewer than 3).
CANDIDATE_BUDGET_S = 0.25
#: Two medians within this relative distance are a tie, broken by the smaller workspace.
TIE_TOLERANCE = 0.01

Progress = Callable[[int, int, Candidate], None]


@dataclass
class TunedPlan:
    """The autotuner's result: the serialized winner and what was learned choosing it."""

    blob: bytes
    sha256: str
    workspace_bytes: int
    engine_id: int
    knobs: dict[str, int]
    plan_name: str
    winner_index: int
    heuristic_index: int
    winner_median_ms: float
    heuristic_median_ms: float | None
    worst_median_ms: float | None
    candidates: list[Candidate]
    tuning_seconds: float
    build_seconds: float
    timing_seconds: float
    environment: Environment
    max_abs_err: float
    numerics_check: str = "reference"
    native_median_ms: dict[str, float] = field(default_factory=dict)  # torch's own kernels' (plancache.gpu.native)

    @property
    def speedup_vs_heuristic(self) -> float | None:
        if not self.heuristic_median_ms:
            return None
        return self.heuristic_median_ms / self.winner_median_ms

    def to_meta(self, graph_key: str, worker_id: str) -> PlanMeta:
        """The (unsigned) plan record for this result."""
        return PlanMeta(
            graph_key=graph_key, environment=self.environment, blob_sha256=self.sha256, blob_size=len(self.blob),
            engine_id=self.engine_id, knobs=self.knobs, plan_name=self.plan_name, workspace_bytes=self.workspace_bytes,
            winner_median_ms=self.winner_median_ms, heuristic_median_ms=self.heuristic_median_ms,
            worst_median_ms=self.worst_median_ms, tuning_seconds=self.tuning_seconds,
            worker_id=worker_id, numerics_check=self.numerics_check, native_median_ms=self.native_median_ms,
        )


def autotune(spec: GraphSpec | dict[str, Any], *, device: int = 0, warmup: int = 3, repeats: int = 20,
             progress: Progress | None = None, seed: int | None = None, builders: BuildPool | None = None,
             following: GraphSpec | None = None, cancel: threading.Event | None = None) -> TunedPlan:
    """Build and time every candidate plan of ``spec`` and serialize the fastest one whose output matches
    the float32 torch reference, or for a graph no reference covers, cuDNN's FALLBACK / heuristic plan
    (ties → smaller workspace; :func:`plancache.gpu.runtime.expected_outputs`).

    Each candidate is built and serialized (by ``builders``' processes while earlier ones are timed, or
    here one after another), then its blob is deserialized, checked and timed in this process alone: the
    published blob is the one that was checked and timed. With ``builders``, the builds of ``following`` (the
    graph to be tuned next) are queued as soon as this graph's are (:meth:`BuildPool.ahead`). Once ``cancel`` is set
    (the worker gave up on the job), the next candidate raises :class:`TuningError` and the queued builds are
    cancelled."""
    spec = canonical(spec)
    dev = require_gpu(device)
    t0 = time.perf_counter()
    check_memory(spec, device=device)
    env = detect(device)
    seed = int(time.time_ns() % 2**31) if seed is None else seed
    with torch.cuda.device(dev), contextlib.ExitStack() as cleanup:
        handle = create_handle(device)
        cudnn.set_stream(handle, torch.cuda.current_stream(dev).cuda_stream)
        ahead = builders.take(spec) if builders else None
        if ahead is None:
            g, indices = list_candidates(spec, handle)
            ahead = CandidateSet(g, indices, builders.build(spec, g, indices) if builders else build_in_process(g, indices))
        cleanup.callback(ahead.close)  # a tuning that stops early cancels the builds not started
        g, indices, built = ahead.graph, ahead.indices, ahead.built
        if builders and following is not None:
            builders.ahead(canonical(following))
        device_property = cudnn.create_device_properties(device)

        inputs = reference.make_inputs(spec, dev, seed=seed)
        outputs = reference.allocate_outputs(spec, dev, graph_layouts(g))
        ref, check = expected_outputs(spec, inputs, handle, dev)
        pack = {**inputs, **outputs}
        check_pack(spec, pack)
        tolerance = {t.uid: reference.tolerance(spec, t) for t in spec.output_tensors()}

        candidates: list[Candidate] = []
        timed: list[tuple[float, int, int]] = []  # (median ms, workspace, index)
        blobs: dict[int, bytes] = {}
        build_s = timing_s = 0.0
        workspace = torch.empty(1, dtype=torch.uint8, device=dev)
        for n_done, b in enumerate(built):
            if cancel is not None and cancel.is_set():
                raise TuningError(f"tuning cancelled after {n_done} of {len(indices)} candidates")
            cand: dict[str, Any] = dict(index=b.index, engine_id=b.engine_id, knobs=b.knobs, name=b.name)
            build_s += b.build_seconds
            if b.blob is None:  # a candidate the backend declines to build is data, not a failure
                candidates.append(Candidate(**cand, status="build_failed", error=b.error))
                _report(progress, n_done, len(indices), candidates[-1])
                continue
            ws = b.workspace_bytes
            tt = time.perf_counter()
            try:
                plan = deserialize_plan(spec, b.blob, handle, device_property=device_property)
                if ws > workspace.numel():
                    workspace = torch.empty(ws, dtype=torch.uint8, device=dev)
                for t in outputs.values():
                    t.fill_(float("nan") if t.dtype.is_floating_point else -1)
                plan.execute(pack, workspace, handle)
                torch.cuda.synchronize(dev)
                errs = reference.output_errors(spec, outputs, ref, inputs=inputs)
                err = max(errs.values())
                if (why := reference.first_mismatch(errs, tolerance, check)) is not None:
                    candidates.append(Candidate(**cand, workspace_bytes=ws, max_abs_err=_finite(err), status="mismatch",
                                                error=why))
                else:
                    # a candidate that cannot beat the best so far gets one timing (plancache.gpu.timing)
                    ms = median_ms(partial(plan.execute, pack, workspace, handle),
                                   warmup=warmup, repeats=repeats, budget_s=CANDIDATE_BUDGET_S,
                                   set_stream=lambda sid: cudnn.set_stream(handle, sid),
                                   best_ms=min((t[0] for t in timed), default=None))
                    candidates.append(Candidate(**cand, workspace_bytes=ws, median_ms=ms, max_abs_err=err, status="ok"))
                    timed.append((ms, ws, b.index))
                    blobs[b.index] = b.blob
            except Exception as exc:
                candidates.append(Candidate(**cand, workspace_bytes=ws, status="run_failed", error=str(exc)[:4000]))
            timing_s += time.perf_counter() - tt
            _report(progress, n_done, len(indices), candidates[-1])
        natives = native.measure(spec, pack, partial(_native_check, spec, inputs, ref, tolerance, check),
                                 partial(median_ms, warmup=warmup, repeats=repeats, budget_s=CANDIDATE_BUDGET_S,
                                         set_stream=lambda sid: None)) if timed else {}

    if not timed:
        reasons = "; ".join(f"#{c.index} {c.status}: {c.error}" for c in candidates[:5])
        raise TuningError(f"no candidate plan built, ran and passed the numerics check ({check}; "
                          f"{len(candidates)} tried): {reasons}")
    fastest = min(t[0] for t in timed)
    win_ms, win_ws, win_idx = min((t for t in timed if t[0] <= fastest * (1 + TIE_TOLERANCE)), key=lambda t: (t[1], t[0]))
    heuristic_idx = indices[0]
    heur = next((c for c in candidates if c.index == heuristic_idx), None)
    ok_ms = [c.median_ms for c in candidates if c.median_ms is not None]
    win = next(c for c in candidates if c.index == win_idx)
    if win.engine_id is None:
        raise TuningError(f"winning plan #{win_idx} ({win.name}) exposes no (engine_id, knobs) to record")
    sha256 = hashlib.sha256(blobs[win_idx]).hexdigest()
    blob = Digested(blobs[win_idx], sha256)  # hashed once: the worker's checks and its spool compare this digest
    return TunedPlan(
        blob=blob, sha256=sha256, workspace_bytes=win_ws, engine_id=win.engine_id,
        knobs=win.knobs, plan_name=win.name, winner_index=win_idx, heuristic_index=heuristic_idx,
        winner_median_ms=win_ms, heuristic_median_ms=heur.median_ms if heur else None,
        worst_median_ms=max(ok_ms) if ok_ms else None, candidates=candidates,
        tuning_seconds=time.perf_counter() - t0, build_seconds=build_s, timing_seconds=timing_s,
        environment=env, max_abs_err=float(win.max_abs_err or 0.0), numerics_check=check, native_median_ms=natives,
    )


def _native_check(spec: GraphSpec, inputs: dict[int, torch.Tensor], ref: dict[int, torch.Tensor],
                  tolerance: dict[int, float], check: str, outputs: dict[int, torch.Tensor]) -> str | None:
    """Why a native kernel's ``outputs`` fail the check the candidates passed, or None."""
    missing = sorted(set(tolerance) - set(outputs))
    if missing:
        return f"it gives no output uid {missing[0]}"
    return reference.first_mismatch(reference.output_errors(spec, outputs, ref, inputs=inputs), tolerance, check)


def _finite(x: float) -> float | None:
    """The error as a record states it: None where it is not a finite number a record can hold (``Error``)."""
    return x if math.isfinite(x) and 0 <= x <= MAX_ERROR else None


def _report(progress: Progress | None, done: int, total: int, cand: Candidate) -> None:
    if progress is not None:
        progress(done + 1, total, cand)

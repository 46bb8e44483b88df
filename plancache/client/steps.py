"""The ladder's steps: what a step is (:class:`Step`, :class:`StoreStep`) and the built-in ones but the server's.

Memory → the local disk cache → (the static index, :mod:`plancache.client.index`; the server,
:mod:`plancache.client.server_step`) → a rebuild of an authentic tuned record's ``(engine_id, knobs)`` → a local
heuristic build. A blob from a store is read checked against its name (:meth:`Step.read`), verified (size → sha256
→ signature → graph key → environment → revision, see :mod:`plancache.verify`) and only then deserialized
(:meth:`Step.admit`); a rejected blob is counted by reason and the ladder goes on.

A shape family (the same graph with other dims) shares one cuDNN kernel cache, so the heuristic build of a further
shape of a family reuses the kernels compiled for the first.
"""

from __future__ import annotations

import hashlib
import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from .. import SPEC_SCHEMA_VERSION
from ..canonical import canonical_json
from ..errors import IntegrityError, Reason, VerificationError
from ..verify import is_python_plan
from .context import Builds, LoadContext, Pending, StepName, bump
from .plan import Plan

if TYPE_CHECKING:
    from ..blobs import BlobReader
    from ..protocol import PlanRecord
    from ..spec import GraphSpec
    from .backend import BuiltPlanLike

log = logging.getLogger("plancache.client")

#: Blobs a step downloads at once (the server's from presigned URLs or its route, the index's).
FETCH_THREADS = 8


def family_key(spec: GraphSpec | dict[str, Any] | str | bytes) -> str:
    """The shape family of ``spec``: sha256 of its canonical form with every tensor's dims and strides
    replaced by its rank and its layout order (dimension indices, outermost first)."""
    from ..spec import parse_spec

    doc = parse_spec(spec).canonical()
    for t in doc["tensors"]:
        dims, strides = t["dim"] or [], t["stride"] or []
        t["stride"] = sorted(range(len(strides)), key=lambda i: (-strides[i], i))
        t["dim"] = len(dims)
    payload = f"plancache-family/v{SPEC_SCHEMA_VERSION}\n{canonical_json(doc)}"
    return hashlib.sha256(payload.encode()).hexdigest()



class Step(ABC):
    """One rung of the ladder, made per cache as ``step(context)`` (:class:`LoadContext`). :meth:`resolve` gets the
    loads still pending, in order, and returns the plans it found; for a load it passes on it notes why
    (:meth:`Pending.note`) and may leave an authentic record for a later step (:meth:`learn`). :meth:`finish` runs
    after each load, whatever happened."""

    name: str  # key of stats().hits and fallbacks, Plan.source, prefix of its PlanMiss notes
    builds: Builds
    counts_fallbacks = True  # a load it passes on counts in stats().fallbacks[name]

    def __init__(self, context: LoadContext) -> None:
        self.context = context

    @abstractmethod
    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        """The plans found for loads of ``batch``."""

    def finish(self) -> None:  # noqa: B027 - a hook: most steps hold nothing across a load
        """Called once the load is over (the ladder's lock still held); nothing by default."""

    def wrap(self, p: Pending, built: BuiltPlanLike, record: PlanRecord | None = None) -> Plan:
        """``built`` as a :class:`Plan` from this step (``record``: the verified record it came from)."""
        c = self.context
        return Plan(p.spec, p.key, built, c.backend, source=str(self.name), lock=c.handle_lock, record=record)

    def reject(self, p: Pending, reason: Reason, message: str) -> None:
        """Count, note and log a refused blob."""
        bump(self.context.stats.rejects, reason)
        p.refused = reason
        p.note(self.name, f"rejected ({reason})")
        log.warning("plancache: rejected the %s plan %s (%s): %s", self.name, p.key[:12], reason, message)

    def learn(self, p: Pending, record: PlanRecord) -> None:
        """Keep ``record`` for the rebuild step when it is authentic (its signature verified by a trusted key),
        whatever its blob."""
        if self.context.authentic(record, p.key):
            p.record = record

    def read(self, p: Pending, record: PlanRecord, blobs: BlobReader) -> bytes | None:
        """The blob of ``record`` from ``blobs``, checked against its name as it is read; None when absent (noted)
        or damaged (refused as :meth:`admit` refuses it: ``size`` when its stored length is not the record's, before
        a byte is read, else ``sha256``), or unreadable (logged)."""
        stream = None
        try:
            stream = blobs.open(record.blob_sha256)
            if stream is None:
                p.note(self.name, "no blob")
                return None
            with stream:
                if stream.size != record.blob_size:  # the size step first: a planted huge file is never read
                    raise IntegrityError(f"{stream.source}: blob {record.blob_sha256[:12]} has {stream.size} bytes, "
                                         f"its record says {record.blob_size}")
                return stream.read()
        except IntegrityError as exc:
            reason = Reason.SIZE if stream is None or stream.size != record.blob_size else Reason.SHA256
            self.reject(p, reason, f"plan {p.key[:12]}: {exc.message}")
        except OSError as exc:
            log.warning("plancache: cannot read the %s blob of %s: %s", self.name, p.key[:12], exc)
            p.note(self.name, "blob unreadable")
            return None
        self.learn(p, record)
        return None

    def load(self, p: Pending, record: PlanRecord, blob: bytes) -> BuiltPlanLike | None:
        """The verified ``blob`` deserialized into the caller's graph (a warm load: kept, see :class:`Kept`); None
        when cuDNN refuses it (counted, the record learned for a rebuild), or when it is not loaded at all (counted,
        never rebuilt: :meth:`unloadable`)."""
        if (why := self.unloadable(p, record, blob)) is not None:
            self.reject(p, *why)
            return None
        try:
            return Kept(record) if p.warm else self.context.deserialize(p, record, blob)
        except Exception as exc:  # noqa: BLE001 - cuDNN refusing a verified blob is a rung failure, not fatal
            self.reject(p, Reason.DESERIALIZE, f"{type(exc).__name__}: {exc}")
            self.learn(p, record)
            return None

    @staticmethod
    def unloadable(p: Pending, record: PlanRecord, blob: bytes | None) -> tuple[Reason, str] | None:
        """Why a verified plan is not loaded nor rebuilt for ``p``, or None: more workspace than ``p`` allows, or a
        python-engine blob (FE loads one only into an empty graph, and rebuilding its CuTe DSL kernels takes
        seconds; plancache's tuner never publishes one)."""
        if p.max_workspace is not None and record.workspace_bytes > p.max_workspace:
            return Reason.WORKSPACE, (f"plan {p.key[:12]} needs {record.workspace_bytes} bytes of workspace, more than "
                                      f"the {p.max_workspace} allowed (PLANCACHE_HOOK_MAX_WORKSPACE_BYTES)")
        if blob is not None and is_python_plan(blob):
            return Reason.PYTHON_ENGINE, (f"plan {p.key[:12]} is a python-engine plan (engine {record.engine_id}, FE's "
                                          "CUDNN_FE_PYPLAN blob): plancache does not load those")
        return None

    def admit(self, p: Pending, record: PlanRecord, blob: bytes) -> Plan | None:
        """Verify, then deserialize (a warm load: keep, see :class:`Kept`); None when refused (counted, and an
        authentic record is learned)."""
        c = self.context
        try:
            c.verify(record, blob, p.key)
        except VerificationError as exc:
            self.reject(p, exc.reason, exc.message)
            if exc.reason in ("size", "sha256"):
                self.learn(p, record)
            return None
        if (built := self.load(p, record, blob)) is None:
            return None
        c.verified[p.key] = (record, blob)
        if c.signatures_checked:  # the revision of a signed record only: an unsigned one may say anything
            c.disk.accept_revision(p.key, record.revision)
        return self.wrap(p, built, record)


class Kept:
    """What a warm load (:meth:`PlanCache.warm`) admits in place of a loaded plan: its verified blob waits in the
    cache for the caller's graph that will load it (:class:`MemoryStep`). Never memoized nor returned, never run."""

    def __init__(self, record: PlanRecord) -> None:
        self.workspace_size = record.workspace_bytes
        self.engine_id: int | None = record.engine_id
        self.knobs = dict(record.knobs)
        self.plan_name = record.plan_name

    def execute(self, tensors: dict[int, Any], workspace: Any, handle: Any) -> None:
        raise RuntimeError("a warm load is kept for the graph that will load it; it has no plan to run")

    def layouts(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        return {}


class MemoryStep(Step):
    """Plans this cache already loaded; otherwise the blob admitted earlier (by a caller's graph or a warm load),
    loaded into the caller's graph or a new one."""

    name = StepName.MEMORY
    builds = Builds.NOTHING
    counts_fallbacks = False

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        c = self.context
        found: dict[Pending, Plan] = {}
        for p in batch:
            if p.graph is None and (plan := c.memory.get(p.key)) is not None:
                found[p] = plan.named_as(p.spec)
            elif (held := c.verified.get(p.key)) is not None:
                try:  # checked again: a withdrawal or a newer revision since it was admitted refuses it
                    c.verify(*held, p.key)
                except VerificationError as exc:
                    c.verified.pop(p.key, None)
                    self.reject(p, exc.reason, exc.message)
                    continue
                if (built := self.load(p, *held)) is None:
                    c.verified.pop(p.key, None)
                    continue
                found[p] = self.wrap(p, built, held[0])
        return found


class StoreStep(Step):
    """A step serving stored plans from a records source and a blob store (:meth:`entries`): each record's blob is
    read (:meth:`Step.read`, checked against its name) and admitted (:meth:`Step.admit`: verified, then loaded);
    :meth:`kept` follows a plan admitted, :meth:`dropped` an entry refused. The disk cache and the server are two."""

    builds = Builds.NOTHING

    @abstractmethod
    def entries(self, batch: list[Pending]) -> tuple[dict[Pending, PlanRecord], BlobReader]:
        """The records found for loads of ``batch`` (for the others, why not is noted) and where their blobs are."""

    def kept(self, p: Pending, record: PlanRecord, blob: bytes) -> None:  # noqa: B027 - a hook
        """After the plan of ``record`` was admitted; nothing by default."""

    def dropped(self, p: Pending, record: PlanRecord) -> None:  # noqa: B027 - a hook
        """After ``record`` or its blob was refused (``p.refused`` says why); nothing by default."""

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        records, blobs = self.entries(batch)
        found: dict[Pending, Plan] = {}
        for p, record in records.items():
            p.refused = None  # from here: this entry's refusal, if any
            blob = self.read(p, record, blobs)
            if blob is not None and (plan := self.admit(p, record, blob)) is not None:
                found[p] = plan
                self.kept(p, record, blob)
            elif p.refused is not None:
                self.dropped(p, record)
        return found


class DiskStep(StoreStep):
    """The local disk cache: records from its folder, blobs from its blob store, verified like a server blob; a bad
    entry is dropped, a plan served is marked used and, when due, asked about again in the background."""

    name = StepName.DISK

    def __init__(self, context: LoadContext) -> None:
        super().__init__(context)
        self._due: list[str] = []  # keys served to ask the server about again

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        """The entries on disk; for the rest, when they would be fetched and saved here, the host's turn to fetch
        them (:meth:`~plancache.client.cache.DiskCache.fetch_lock`): held through the server step, or, when another
        process held it, what that process wrote."""
        found = super().resolve(batch)
        c, left = self.context, [p for p in batch if p not in found]
        if left and (c.remote is not None or c.index is not None) and c.signatures_checked:
            lock = c.disk.fetch_lock([p.key for p in left], c.request_deadline)
            if lock is not None and lock.waited:
                lock.release()
                found.update(super().resolve(left))
            else:
                c.fetch_lock = lock  # released once the server step's disk writes are asked for (or by finish())
        c.revalidator.schedule(self._due)  # in the background, after this load
        self._due = []
        return found

    def entries(self, batch: list[Pending]) -> tuple[dict[Pending, PlanRecord], BlobReader]:
        disk = self.context.disk
        records: dict[Pending, PlanRecord] = {}
        for p in batch:
            try:
                record = disk.record(p.key)
            except VerificationError as exc:
                self.reject(p, exc.reason, exc.message)
                disk.discard(p.key)
                continue
            if record is None:
                p.note(self.name, "no entry")
            else:
                records[p] = record
        return records, disk.blobs

    def kept(self, p: Pending, record: PlanRecord, blob: bytes) -> None:
        self.context.disk.touch(record)
        if self.context.revalidator.due(p.key):
            self._due.append(p.key)

    def dropped(self, p: Pending, record: PlanRecord) -> None:
        if p.refused != Reason.NO_TRUSTED_KEYS:  # refused for want of keys, the entry itself was not judged
            self.context.disk.discard(p.key, record.blob_sha256)

    def finish(self) -> None:
        """Release the host's turn to fetch once the plans fetched are written: the processes waiting read them."""
        self.context.release_fetch_lock()



class RebuildStep(Step):
    """The ``(engine_id, knobs)`` of an authentic tuned record whose blob could not be used, built here."""

    name = StepName.REBUILD
    builds = Builds.TUNED_CONFIG

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        found: dict[Pending, Plan] = {}
        for p in batch:
            if p.record is None:
                p.note(self.name, "no authentic tuned record")
            elif (why := self.unloadable(p, p.record, None)) is not None:
                self.reject(p, *why)
            elif (plan := self._rebuild(p, p.record)) is not None:
                found[p] = plan
        return found

    def _rebuild(self, p: Pending, record: PlanRecord) -> Plan | None:
        c, t0 = self.context, time.perf_counter()
        try:
            with c.handle_lock:
                built = c.backend.build_engine_config(p.spec, record.engine_id, record.knobs, graph=p.graph)
        except Exception as exc:  # noqa: BLE001 - the recorded config may not build here; the next rung decides
            p.note(self.name, f"engine {record.engine_id} failed ({type(exc).__name__})")
            log.warning("plancache: rebuilding engine %s of %s failed: %s", record.engine_id, p.key[:12], exc)
            return None
        finally:
            c.stats.build_seconds += time.perf_counter() - t0
        return self.wrap(p, built, record)


class HeuristicStep(Step):
    """A local heuristic build, sharing the kernel cache of the spec's shape family (a caller's own graph is
    built as it was made). Never passes a load on: a failing build raises."""

    name = StepName.HEURISTIC
    builds = Builds.HEURISTIC

    def __init__(self, context: LoadContext) -> None:
        super().__init__(context)
        self.kernel_caches: dict[str, Any] = {}
        self.static_families: set[str] = set()  # families whose dynamic-shape build failed

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        return {p: self._build(p) for p in batch}

    def _build(self, p: Pending) -> Plan:
        c, family = self.context, family_key(p.spec)
        t0 = time.perf_counter()
        try:
            with c.handle_lock:
                if p.graph is not None:
                    return self.wrap(p, c.backend.build_heuristic(p.spec, None, graph=p.graph))
                if family not in self.static_families:
                    try:
                        kc = self.kernel_caches.get(family)
                        if kc is None:
                            kc = self.kernel_caches[family] = c.backend.create_kernel_cache()
                        return self.wrap(p, c.backend.build_heuristic(p.spec, kc))
                    except Exception as exc:  # noqa: BLE001 - dynamic shapes unsupported for this graph
                        log.info("plancache: dynamic-shape build of %s failed (%s: %s); building its family statically",
                                 p.key[:12], type(exc).__name__, exc)
                        self.static_families.add(family)
                        self.kernel_caches.pop(family, None)
                return self.wrap(p, c.backend.build_heuristic(p.spec, None))
        finally:
            c.stats.build_seconds += time.perf_counter() - t0


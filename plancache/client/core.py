"""``PlanCache``: ready plans for this GPU, through a counted fallback ladder.

The ladder is a list of :class:`Step` objects (:data:`LADDER`), tried in order for a whole batch of loads:
memory → the local disk cache → the server (one ``POST /v1/plans/resolve`` for the batch) → a rebuild of the
tuned record's ``(engine_id, knobs)`` → a local heuristic build. A blob from disk or server is verified first
(size → sha256 → signature → graph key → environment → revision, see :mod:`plancache.verify`) and only
then deserialized; a rejected blob is counted by reason and the ladder goes on. A mode is the kinds of step it
allows (:data:`MODE_STEPS`, by :class:`Builds`):

- ``normal``: the whole ladder; a plan is always returned (unless the local build itself fails).
- ``strict``: tuned plans only — a verified blob, or the rebuild of an authentic tuned record whose
  blob bytes were damaged; never a heuristic build. Otherwise :class:`~plancache.errors.PlanMiss`.
- ``replay_only``: never builds anything: verified blobs only, :class:`~plancache.errors.PlanMiss` otherwise.

Signatures: a plan is admitted only with a valid signature by a trusted key (``PLANCACHE_TRUSTED_KEYS``).
Without trusted keys every disk or server plan is refused (reason ``no_trusted_keys``) and, in normal mode,
built locally — unless ``insecure_allow_unsigned`` (``PLANCACHE_INSECURE_ALLOW_UNSIGNED``) is set, which in
normal mode only admits plans checked by size and digest alone; strict and replay-only modes ignore it. A plan
admitted without a signature is never written to the disk cache, and only a record whose signature verified is
rebuilt from its ``(engine_id, knobs)``. The revision of every signed plan admitted is remembered in the disk
cache (:meth:`~plancache.client.cache.DiskCache.accept_revision`), and a record older than the highest one
remembered for its graph key is refused (reason ``revision``): an old signed record cannot be replayed.

A plan served from the disk cache is asked about again in the background once the server last confirmed it longer
ago than ``revalidate_seconds`` (:mod:`plancache.client.revalidate`): a replaced plan's entry is replaced, a
withdrawn plan's deleted, for the next load from disk; a withdrawal the server gives for a missed key is applied
the same way.

The server is asked once per load (one ``plan``/``prefetch``) and all of it — resolve, blob downloads, spec
registrations — must be done within ``request_deadline`` seconds; every answer is read with a size limit
(:mod:`plancache.client.remote`). Past either, the server counts as failed for that load and its breaker opens.

A new step is one :class:`Step` subclass and one entry in :data:`LADDER` (or in ``ClientConfig.steps``); a step
sees only its cache's :class:`LoadContext` (verify, deserialize, counters, the disk cache, the remote). A step that
serves stored plans reads a record, then its blob from a :class:`~plancache.blobs.BlobReader` (:meth:`Step.read`,
checked against its name as it is read), then admits it (:meth:`Step.admit`).

A shape family (the same graph with other dims) shares one cuDNN kernel cache, so the heuristic
build of a further shape of a family reuses the kernels compiled for the first.

The caller's own ``cudnn.pygraph`` goes through the same ladder (:meth:`PlanCache.build`): its spec is
read from FE's IR, its auto-assigned uids are renumbered to the canonical ones, and the tuned plan is
deserialized into it (or built in it), so it then runs with the caller's own ``graph.execute`` call.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum, StrEnum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .. import SPEC_SCHEMA_VERSION
from ..canonical import canonical_json
from ..errors import (
    ForkedProcess,
    IntegrityError,
    PlanCacheError,
    PlanMiss,
    Reason,
    ServerUnavailable,
    VerificationError,
)
from ..verify import is_python_plan, verify_blob
from .backend import Backend, BuiltPlanLike
from .plan import Plan

if TYPE_CHECKING:  # imported by the first PlanCache made, not with this module (plancache.client's docstring)
    import httpx
    from cachetools import TTLCache

    from ..blobs import BlobReader
    from ..environment import Environment
    from ..protocol import MissReason, PlanRecord, ResolvedPlan
    from ..settings import ClientSettings
    from ..signing import TrustedKeys
    from ..spec import GraphSpec
    from .cache import DiskCache, FetchLock
    from .index import IndexSource
    from .remote import Remote
    from .revalidate import Revalidator

log = logging.getLogger("plancache.client")

Mode = Literal["normal", "strict", "replay_only"]
#: A spec (model, dict or JSON text) or a caller's ``cudnn.pygraph``.
SpecLike = Any


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


def _bump(counter: dict[str, int], key: str, n: int = 1) -> None:
    counter[key] = counter.get(key, 0) + n


# ------------------------------------------------------------ the ladder's steps


class StepName(StrEnum):
    """The built-in steps: keys of ``stats().hits`` / ``fallbacks`` and values of ``Plan.source``."""

    MEMORY = "memory"
    DISK = "disk"
    INDEX = "index"
    SERVER = "server"
    REBUILD = "rebuild"
    HEURISTIC = "heuristic"


class Builds(Enum):
    """What a step builds; a mode allows some of these (:data:`MODE_STEPS`)."""

    NOTHING = "nothing"            # serves a loaded plan or a verified tuned blob; any other plan is a miss
    TUNED_CONFIG = "tuned_config"  # builds the (engine_id, knobs) of an authentic tuned record
    HEURISTIC = "heuristic"        # builds from cuDNN's heuristics


#: The kinds of steps each mode allows.
MODE_STEPS: dict[Mode, frozenset[Builds]] = {
    "normal": frozenset(Builds),
    "strict": frozenset({Builds.NOTHING, Builds.TUNED_CONFIG}),
    "replay_only": frozenset({Builds.NOTHING}),
}
MODES: tuple[str, ...] = tuple(MODE_STEPS)
#: The kinds of steps :meth:`PlanCache.serve` takes in each mode: never a heuristic build (the caller's FE builds).
SERVING_STEPS: dict[Mode, frozenset[Builds]] = {m: s - {Builds.HEURISTIC} for m, s in MODE_STEPS.items()}


@dataclass(eq=False)
class Pending:
    """One load on its way down the ladder (hashed by identity)."""

    key: str
    spec: GraphSpec
    graph: Any  # the caller's pygraph, or None
    trail: list[str] = field(default_factory=list)  # why each step passed it on, for PlanMiss
    record: PlanRecord | None = None  # an authentic tuned record whose blob could not be used
    refused: Reason | None = None  # the reason of the last refusal of a blob for it
    warm: bool = False  # a warm load (PlanCache.warm): a verified blob is kept for the graph to come, not loaded
    max_workspace: int | None = None  # a plan needing more workspace bytes is refused (the hook's cap)

    def note(self, step: str, what: str) -> None:
        self.trail.append(f"{step}: {what}")


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

    def wrap(self, p: Pending, built: BuiltPlanLike) -> Plan:
        """``built`` as a :class:`Plan` from this step."""
        c = self.context
        return Plan(p.spec, p.key, built, c.backend, source=str(self.name), lock=c.handle_lock)

    def reject(self, p: Pending, reason: Reason, message: str) -> None:
        """Count, note and log a refused blob."""
        _bump(self.context.stats.rejects, reason)
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
        return self.wrap(p, built)


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
                found[p] = self.wrap(p, built)
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


#: Blobs the server step downloads at once (from presigned URLs or the server's route).
FETCH_THREADS = 8
#: Seconds a process does not ask the server again about a key it missed (so the miss is not counted again), and
#: how many such keys it remembers (the oldest forgotten first: asked again).
MISS_RECHECK_SECONDS = 60.0
MISS_MEMORY_KEYS = 10_000
#: Times a process sends the spec of a key whose registration failed for now (429, 5xx, unreachable, past the
#: deadline, 408) before it gives up: once per miss of the key, so at most once every :data:`MISS_RECHECK_SECONDS`.
REGISTER_ATTEMPTS = 3
#: Seconds :meth:`PlanCache.close` gives the revalidation under way to end (a server that answers does so in
#: milliseconds), and then, its request abandoned, to write what it has.
CLOSE_GRACE_SECONDS, CLOSE_WAIT_SECONDS = 1.0, 0.5


class ServerStep(StoreStep):
    """One resolve round trip for the batch, blobs inline or fetched from where the answer says (a presigned
    object-store URL, without the token, or the server's route), all of it within the cache's
    ``request_deadline`` and each answer within its size limit; a verified blob whose signature was checked is
    saved to disk. The specs of the keys the server misses are registered once per process (time allowing), so
    an admin can tune them; a key it missed is not asked about again for :data:`MISS_RECHECK_SECONDS` (a process
    that loads it on every call neither waits on the server each time nor counts a miss each time). A registration
    that failed for now is sent again at a later miss of its key, :data:`REGISTER_ATTEMPTS` times at most."""

    name = StepName.SERVER

    def __init__(self, context: LoadContext) -> None:
        super().__init__(context)
        self.counts_fallbacks = context.remote is not None
        self._reported: set[str] = set()  # registered, refused for good, or out of attempts: not sent again
        self._failed: dict[str, int] = {}  # key: its registrations sent that failed for now
        self._may_register = True
        from cachetools import TTLCache  # with the first PlanCache, not the import

        # key: when the server missed it, and why (steps run under the context's lock: no lock of its own)
        self._missed: TTLCache[str, tuple[float, MissReason | None]] = TTLCache(MISS_MEMORY_KEYS, MISS_RECHECK_SECONDS)

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        try:
            return super().resolve(batch)
        finally:  # what it fetched is queued for the disk: the processes waiting need not wait for local builds
            self.context.release_fetch_lock()

    def entries(self, batch: list[Pending]) -> tuple[dict[Pending, PlanRecord], BlobReader]:
        """The records the server resolves for ``batch``, with the blobs received for them (the misses explained,
        withdrawals applied, specs registered)."""
        from .received import ReceivedBlobs

        c = self.context
        records: dict[Pending, PlanRecord] = {}
        received = ReceivedBlobs("the server" if c.remote is None else c.remote.http.server_url)
        if c.remote is None:
            for p in batch:
                p.note(self.name, "none configured")
            return records, received
        now = time.monotonic()
        deadline = now + c.request_deadline
        known = {p.key: missed for p in batch if (missed := self._missed.get(p.key)) is not None}
        specs = {p.key: p.spec for p in batch if p.key not in known}
        answers, missing = self._ask(specs, deadline) if specs else ({}, [])
        fresh = [k for k in missing if k in specs]
        reasons = self._explain(fresh, deadline)
        blobs = self._blobs([(p, answers[p.key]) for p in batch if answers and p.key in answers], deadline)
        registered = {k for k in fresh if self._register(k, specs[k], deadline)}
        reasons = {k: _registered_now(r) if k in registered else r for k, r in reasons.items()}
        self._missed.update((k, (now, reasons.get(k))) for k in fresh)
        for p in batch:
            if p.key in known or (answers is not None and p.key not in answers):
                asked, reason = known.get(p.key, (now, reasons.get(p.key)))
                ago = f" {now - asked:.0f} s ago" if p.key in known else ""
                why = reason.message if reason else "none for this environment"
                p.note(self.name, f"no plan{ago}: {why}" if reason or ago else "no plan for this environment")
                _bump(self.context.stats.miss_reasons, reason.reason if reason else "unexplained")
            elif answers is None:
                p.note(self.name, "unavailable")
            elif (blob := blobs[p]) is not None:  # else refused or not downloaded, and noted so
                records[p] = answers[p.key].record
                received.add(records[p].blob_sha256, blob)
        for key, reason in reasons.items():
            if reason.withdrawal is not None:
                from .revalidate import apply_withdrawal

                apply_withdrawal(self.context, key, reason.withdrawal)
        return records, received

    def kept(self, p: Pending, record: PlanRecord, blob: bytes) -> None:
        c = self.context
        if c.signatures_checked:  # an unsigned plan is used, never kept
            c.disk.later(partial(c.disk.save, checked=True), record, blob)  # written after the plans are ready

    def _blobs(self, answers: list[tuple[Pending, ResolvedPlan]], deadline: float) -> dict[Pending, bytes | None]:
        """The answers' blobs (unverified): inline, or downloaded from their ``blob_url`` (at most their record's
        size, :data:`FETCH_THREADS` at a time) when their record could be admitted at all; None when there is none
        (the reason is noted). Counted by where they came from (``stats().blob_sources``)."""
        blobs: dict[Pending, bytes | None] = {}
        downloads: list[tuple[Pending, ResolvedPlan]] = []
        for p, answer in answers:
            if answer.blob_b64 is not None:
                blobs[p] = self._inline(p, answer)
                continue
            try:  # the record alone first: no download for a record that cannot be admitted anyway
                self.context.verify(answer.record, None, p.key)
            except VerificationError as exc:
                self.reject(p, exc.reason, exc.message)
                blobs[p] = None
                continue
            downloads.append((p, answer))
        if not downloads:
            return blobs
        from concurrent.futures import ThreadPoolExecutor

        def download(d: tuple[Pending, ResolvedPlan]) -> tuple[bytes | PlanCacheError, str, bool]:
            return self._download(d[1], deadline)

        try:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(downloads)), thread_name_prefix="plancache-blob") as pool:
                results = list(pool.map(download, downloads))
        except RuntimeError:  # the interpreter is exiting (no new threads): one at a time, on this thread
            results = [download(d) for d in downloads]
        stats = self.context.stats
        for (p, answer), (blob, source, fell_back) in zip(downloads, results, strict=True):
            stats.presigned_fallbacks += fell_back
            if isinstance(blob, PlanCacheError):
                self._count_failure(blob)
                p.note(self.name, "blob unavailable")
                self.learn(p, answer.record)
                blobs[p] = None
            else:
                _bump(stats.blob_sources, source)
                blobs[p] = blob
        return blobs

    def _inline(self, p: Pending, answer: ResolvedPlan) -> bytes | None:
        from ..protocol import b64decode

        assert answer.blob_b64 is not None
        try:
            blob = b64decode(answer.blob_b64)
        except ValueError as exc:
            self.reject(p, Reason.MALFORMED, str(exc))
            self.learn(p, answer.record)
            return None
        _bump(self.context.stats.blob_sources, "inline")
        return blob

    def _download(self, answer: ResolvedPlan, deadline: float) -> tuple[bytes | PlanCacheError, str, bool]:
        """(the blob or why not, ``server`` or ``presigned``, whether a presigned URL failed first). A presigned
        URL that fails (expired, refused, unreachable) is followed by one GET from the server's route."""
        record, url = answer.record, answer.blob_url
        fetch = partial(self._remote().fetch_blob, record.blob_sha256, size=record.blob_size, deadline=deadline)
        fell_back = False
        if url is not None and not url.startswith("/"):
            try:
                return fetch(url=url), "presigned", False
            except PlanCacheError as exc:
                log.info("plancache: blob %s from its presigned URL: %s; asking the server", record.blob_sha256[:12],
                         exc.message)
                fell_back = True
        try:
            return fetch(url=url if not fell_back else None), "server", fell_back
        except PlanCacheError as exc:
            return exc, "server", fell_back

    def _remote(self) -> Remote:
        assert self.context.remote is not None
        return self.context.remote

    def _count_failure(self, exc: PlanCacheError) -> None:
        stats = self.context.stats
        if isinstance(exc, ServerUnavailable) and exc.skipped:
            stats.remote_skipped += 1
        else:
            stats.remote_errors += 1
            log.warning("plancache: %s", exc.message)

    def _ask(self, specs: dict[str, GraphSpec], deadline: float) -> tuple[dict[str, ResolvedPlan] | None, list[str]]:
        """One resolve for all keys of ``specs``: the plans (None: no answer) and the keys the server misses.
        Without a way to check signatures, only records are asked for (they are refused all the same)."""
        c = self.context
        try:
            resp = self._remote().resolve(c.environment, list(specs), include_blobs=c.signatures_checked or
                                          c.insecure_allow_unsigned, deadline=deadline)
        except PlanCacheError as exc:
            self._count_failure(exc)
            return None, []
        return resp.plans, resp.missing

    def _explain(self, keys: list[str], deadline: float) -> dict[str, MissReason]:
        """Why the server has no plan for ``keys`` (empty when it cannot say in time, or has no explain route)."""
        if not keys or time.monotonic() >= deadline:
            return {}
        try:
            return self._remote().explain(self.context.environment, keys, deadline=deadline)
        except PlanCacheError as exc:
            log.debug("plancache: the server did not explain its misses: %s", exc.message)
            return {}

    def _register(self, key: str, spec: GraphSpec, deadline: float) -> bool:
        """The resolve recorded the miss; store the spec too, once per process, so an admin can tune it: whether
        this call stored it. Not sent once the deadline has passed (a later load of the key sends it); one that
        failed for now is sent again at a later miss of the key, one refused for good is not (:meth:`_gives_up`)."""
        if key in self._reported or not self._may_register or time.monotonic() >= deadline:
            return False
        try:
            self._remote().register_spec(spec, deadline=deadline)
            registered = True
        except PlanCacheError as exc:
            registered = False
            if not self._gives_up(key, exc):
                return False
        self._reported.add(key)
        self._failed.pop(key, None)
        return registered

    def _gives_up(self, key: str, exc: PlanCacheError) -> bool:
        """Whether the registration of ``key`` that failed with ``exc`` is not to be sent again (said so): refused
        for good (401/403: by no key; a spec refused, 409, 413, 422…), or failed for now (429, 5xx, unreachable,
        past the deadline, 408) :data:`REGISTER_ATTEMPTS` times. One the remote held back unsent is no attempt."""
        if isinstance(exc, ServerUnavailable):
            self._count_failure(exc)
            if exc.skipped:
                return False
        if isinstance(exc, ServerUnavailable) or exc.http_status == 408:  # 408: the body came in too slowly
            self._failed[key] = failed = self._failed.get(key, 0) + 1
            if failed < REGISTER_ATTEMPTS:
                return False
            log.warning("plancache: could not register the spec of %s in %d attempts (%s); this process does not send "
                        "it again (an admin can: plancache enqueue)", key[:12], failed, exc.message)
        elif exc.http_status in (401, 403):
            self._may_register = False
            log.info("plancache: this token may not register specs (%s); misses are still recorded by resolve",
                     exc.message)
        else:
            log.warning("plancache: could not register the spec of %s: %s", key[:12], exc.message)
        return True


def _registered_now(reason: MissReason) -> MissReason:
    """``reason`` once this process registered the spec: the server explains a miss before the spec reaches it, so
    its ``not_registered`` message ("a client that misses it registers it") is past; this one says what comes next."""
    if reason.reason != "not_registered":
        return reason
    return reason.model_copy(update={"message": (
        "the server had never seen this graph's spec: this process registered it after the miss; autotune queues it "
        "once it missed PLANCACHE_AUTOTUNE_MIN_MISSES times here (where the server runs autotune and a worker "
        "serves this GPU), or an admin enqueues it (POST /v1/admin/tune/misses, plancache enqueue)")})


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
        return self.wrap(p, built)


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


StepFactory = Callable[["LoadContext"], Step]


def index_step(context: LoadContext) -> Step:
    """The static index's step (:class:`plancache.client.index.IndexStep`), imported when a cache is made."""
    from .index import IndexStep

    return IndexStep(context)


#: The ladder, in order; a mode keeps the steps it allows.
LADDER: tuple[StepFactory, ...] = (MemoryStep, DiskStep, index_step, ServerStep, RebuildStep, HeuristicStep)


# ------------------------------------------------------------ the client


@dataclass(frozen=True)
class ClientConfig:
    """Options of a :class:`PlanCache`. ``None`` takes the setting (read when the cache is made, from ``settings`` or
    the environment): ``server_url`` ``PLANCACHE_SERVER_URL`` (``""``: no server, disk cache and local builds only),
    ``token`` ``PLANCACHE_TOKEN``, ``trusted_keys`` ``PLANCACHE_TRUSTED_KEYS`` (or a path, or paths: key files and
    folders of ``*.pub``), ``cache_dir`` ``PLANCACHE_CACHE_DIR``, ``connect_timeout``/``read_timeout``
    ``PLANCACHE_CONNECT_TIMEOUT``/``READ_TIMEOUT``, ``request_deadline`` ``PLANCACHE_REQUEST_DEADLINE`` (seconds for
    the whole server exchange of one load), ``cache_max_bytes`` ``PLANCACHE_CACHE_MAX_BYTES`` (disk cache cap, 0:
    none), ``insecure_allow_unsigned`` ``PLANCACHE_INSECURE_ALLOW_UNSIGNED`` (normal mode without trusted keys only:
    admit plans checked by digest alone, never written to disk; ignored by strict and replay-only modes),
    ``revalidate_seconds`` ``PLANCACHE_REVALIDATE_SECONDS`` (a plan loaded from disk that the server last confirmed
    longer ago is asked about again in the background: :mod:`plancache.client.revalidate`), ``index_url``
    ``PLANCACHE_INDEX_URL`` (a published static index read before the server, ``""``: none:
    :mod:`plancache.client.index`), ``index_sets`` ``PLANCACHE_INDEX_SETS`` (its named sets read first). After a server failure
    the server is not asked again for ``cooldown`` seconds. ``backend`` defaults to
    :class:`~plancache.client.backend.GpuBackend` on CUDA device ``device``; ``environment`` to the backend's
    fingerprint. ``steps``: the ladder, before the mode filters it."""

    server_url: str | None = None
    token: str | None = field(default=None, repr=False)
    trusted_keys: TrustedKeys | str | Path | Iterable[str | Path] | None = None
    cache_dir: Path | str | None = None
    mode: Mode = "normal"
    cooldown: float = 30.0
    connect_timeout: float | None = None
    read_timeout: float | None = None
    request_deadline: float | None = None
    cache_max_bytes: int | None = None
    insecure_allow_unsigned: bool | None = None
    revalidate_seconds: float | None = None
    index_url: str | None = None
    index_sets: str | None = None
    environment: Environment | None = None
    backend: Backend | None = None
    device: int = 0
    settings: ClientSettings | None = None
    transport: httpx.BaseTransport | None = None
    steps: tuple[StepFactory, ...] = LADDER

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.request_deadline is not None and self.request_deadline <= 0:
            raise ValueError("request_deadline must be > 0")
        if self.revalidate_seconds is not None and self.revalidate_seconds < 0:
            raise ValueError("revalidate_seconds must be >= 0")


@dataclass
class ClientStats:
    """What the ladder did. ``hits[step]``: plans returned by step (``memory``, ``disk``, ``index``, ``server``,
    ``rebuild``, ``heuristic``). ``misses``: loads that found no verified tuned blob. ``rejects[reason]``:
    blobs refused (never deserialized; ``deserialize`` counts verified blobs cuDNN refused to load).
    ``fallbacks[step]``: times the ladder went past ``disk``, ``server`` or ``rebuild`` to a lower rung.
    ``remote_errors``: failed server requests; ``remote_skipped``: requests not sent because the
    remote was off after a failure. ``fe_builds[reason]``: graphs of the process that the hook
    (:mod:`plancache.client.hook`) left to FE to build, by why (``miss``: normal mode, no tuned plan; the
    others: FE.md's "built by FE" table). ``miss_reasons[reason]``: keys the server had no plan for, by the
    reason it gave (:class:`~plancache.protocol.MissReason`: ``not_registered``, ``not_queued``, ``queued``,
    ``running``, ``failed``, ``other_environments``, ``withdrawn``; ``unexplained`` when it gave none). Seconds: ``load``
    (inside ``plan``/``prefetch``/``serve``/``warm``), ``deserialize``, ``build`` (rebuilds and heuristic builds).
    ``revalidations[outcome]``: keys loaded from disk asked about again (:data:`~plancache.client.revalidate.OUTCOMES`:
    ``current``, ``replaced``, ``withdrawn``, ``kept``, ``failed``); ``withdrawals[what]``: withdrawals the server gave
    (``applied``; ``not_newer``: not above the revision known here; or why one was refused, e.g. ``bad_signature``).
    ``blob_sources[where]``: blobs the server step received (before verification), by where: ``inline`` (in the
    resolve answer), ``server`` (its ``/v1/blobs`` route), ``presigned`` (an object-store URL the server presigned);
    and ``index``, those the static index step read (:mod:`plancache.client.index`: a refused root counts in
    ``rejects`` by reason, an unreachable one in ``remote_errors``). ``presigned_fallbacks``: presigned GETs that
    failed, or were refused (a plain-http URL from an https server, :class:`~plancache.client.remote.Remote`), and
    were asked of the server's route instead."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    rejects: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    remote_errors: int = 0
    remote_skipped: int = 0
    load_seconds: float = 0.0
    deserialize_seconds: float = 0.0
    build_seconds: float = 0.0
    fe_builds: dict[str, int] = field(default_factory=dict)
    miss_reasons: dict[str, int] = field(default_factory=dict)
    revalidations: dict[str, int] = field(default_factory=dict)
    withdrawals: dict[str, int] = field(default_factory=dict)
    blob_sources: dict[str, int] = field(default_factory=dict)
    presigned_fallbacks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(eq=False)
class LoadContext:
    """All that the ladder's steps, and the revalidation of disk entries, use of their :class:`PlanCache` (one per
    cache; a step is made as ``step(context)``).

    :meth:`verify` checks a plan against ``environment``, ``trusted_keys`` (``insecure_allow_unsigned``: normal mode
    without keys admits unsigned plans) and the revisions ``disk`` accepted; :meth:`deserialize` loads one on
    ``backend``, holding ``handle_lock`` (the cuDNN handle, also held by builds and executions). ``stats``: the
    counters, guarded by ``lock`` (held by the ladder; :meth:`count` takes it off the ladder's thread). ``disk``: the
    disk cache; ``remote``: the server (None: none), each load's exchange within ``request_deadline`` seconds.
    ``memory``: the plans loaded, ``verified``: the blobs admitted (for the callers' own graphs), by graph key.
    ``revalidator`` asks the server about entries loaded from disk last confirmed ``revalidate_seconds`` ago."""

    environment: Environment
    trusted_keys: TrustedKeys
    insecure_allow_unsigned: bool
    backend: Backend
    disk: DiskCache
    remote: Remote | None
    request_deadline: float
    revalidate_seconds: float
    stats: ClientStats = field(default_factory=ClientStats)
    lock: threading.RLock = field(default_factory=threading.RLock)
    handle_lock: threading.Lock = field(default_factory=threading.Lock)
    memory: dict[str, Plan] = field(default_factory=dict)
    verified: dict[str, tuple[PlanRecord, bytes]] = field(default_factory=dict)
    revalidator: Revalidator = field(init=False)
    #: This host's turn to fetch the load's missing keys (:meth:`~plancache.client.cache.DiskCache.fetch_lock`), taken
    #: by the disk step.
    fetch_lock: FetchLock | None = None
    #: The static index (:mod:`plancache.client.index`); None: none configured.
    index: IndexSource | None = None

    def __post_init__(self) -> None:
        from .revalidate import Revalidator

        self.revalidator = Revalidator(self, self.revalidate_seconds)

    @property
    def signatures_checked(self) -> bool:
        """Whether trusted keys are configured, so that a plan's signature can be verified."""
        return len(self.trusted_keys) > 0

    def verify(self, record: PlanRecord, blob: bytes | None, key: str, *, signed: bool | None = None) -> None:
        """Every step of :func:`~plancache.verify.verify_blob`; with ``blob`` None, the record's alone. A signature
        by a trusted key is required (``signed``, default: unless unsigned plans are allowed); without trusted
        keys that fails with ``no_trusted_keys``. The revision must not be below the highest one accepted."""
        verify_blob(record, blob, what=f"plan {key[:12]}", trusted=self.trusted_keys, graph_key=key,
                    environment=self.environment,
                    require_signature=not self.insecure_allow_unsigned if signed is None else signed,
                    min_revision=self.disk.revision(key))

    def release_fetch_lock(self) -> None:
        """Let the processes waiting for this load's fetch go once the disk writes asked for so far are done."""
        lock, self.fetch_lock = self.fetch_lock, None
        if lock is not None:
            self.disk.later(lock.release)

    def authentic(self, record: PlanRecord, key: str) -> bool:
        """The record's signature verifies by a trusted key and it is meant for this graph and GPU, whatever its
        blob: only such a record's ``(engine_id, knobs)`` may be rebuilt."""
        try:
            self.verify(record, None, key, signed=True)
        except VerificationError:
            return False
        return True

    def deserialize(self, p: Pending, record: PlanRecord, blob: bytes) -> BuiltPlanLike:
        """Load ``blob`` into the caller's graph (or a new one); its time counts in ``stats.deserialize_seconds``,
        whichever step loads it."""
        t0 = time.perf_counter()
        try:
            with self.handle_lock:
                return self.backend.deserialize(p.spec, blob, engine_id=record.engine_id, knobs=record.knobs,
                                                plan_name=record.plan_name, graph=p.graph)
        finally:
            with self.lock:
                self.stats.deserialize_seconds += time.perf_counter() - t0

    def count(self, counter: str, key: str) -> None:
        """Add one to ``stats.<counter>[key]`` from any thread."""
        with self.lock:
            _bump(getattr(self.stats, counter), key)


def _trusted_keys(value: TrustedKeys | str | Path | Iterable[str | Path] | None) -> TrustedKeys:
    """``trusted_keys=``: the keys themselves; a string as ``PLANCACHE_TRUSTED_KEYS`` reads it; one path, or several,
    each a public key file or a folder of ``*.pub`` files."""
    from ..errors import SignatureError
    from ..signing import TrustedKeys

    if isinstance(value, TrustedKeys):
        return value
    try:  # a named folder holding no key is refused there: never "no keys configured"
        if value is None or isinstance(value, str):
            return TrustedKeys.from_setting(value)
        return TrustedKeys.from_files([value] if isinstance(value, Path) else list(value))
    except SignatureError as exc:
        raise SignatureError(exc.reason, f"trusted_keys (PLANCACHE_TRUSTED_KEYS): {exc.message}") from None


class PlanCache:
    """Ready cuDNN plans for the GPU of this process, tuned plans first.

    ``PlanCache(config)``, or ``PlanCache(server_url, token=..., ...)`` with the fields of :class:`ClientConfig`
    as keywords (given with a config, they replace its fields). Every blob must carry a valid signature by one
    of the trusted keys; without trusted keys no disk or server plan is admitted (reason ``no_trusted_keys``)
    unless, in normal mode, ``insecure_allow_unsigned`` is set (see the module docstring). Thread-safe: loads run one
    at a time, but :meth:`plan` of an already loaded spec never waits for them (it hashes the spec, so keep the
    returned :class:`Plan` in hot loops); all plans share one cuDNN handle, used by one thread at a time.
    """

    def __init__(self, config: ClientConfig | str | None = None, /, **options: Any) -> None:
        from ..http import CircuitBreaker, HttpClient
        from ..settings import ClientSettings
        from .cache import DiskCache
        from .remote import Remote

        if not isinstance(config, ClientConfig):
            config = ClientConfig(**{"server_url": config, **options})
        elif options:
            config = replace(config, **options)
        self.config = config
        settings = config.settings or ClientSettings()  # the client's variables only
        self.mode: Mode = config.mode
        backend = config.backend
        if backend is None:
            from .backend import GpuBackend

            backend = GpuBackend(config.device)
        self._backend = backend
        self.environment = config.environment or backend.environment()
        keys = config.trusted_keys
        self.trusted_keys = _trusted_keys(keys if keys is not None else settings.trusted_keys)
        opt_out = config.insecure_allow_unsigned
        opt_out = settings.insecure_allow_unsigned if opt_out is None else opt_out
        #: Plans are admitted without a signature (normal mode, no trusted keys, and the explicit opt-out).
        self.insecure_allow_unsigned = bool(opt_out) and not self.signatures_checked and self.mode == "normal"
        self._warn_about_keys(bool(opt_out))
        self.request_deadline = config.request_deadline or settings.request_deadline
        if self.request_deadline <= 0:
            raise ValueError("request_deadline must be > 0")
        url = config.server_url if config.server_url is not None else settings.server_url
        self._remote = Remote(HttpClient(url, config.token if config.token is not None else settings.token,
                                         connect_timeout=config.connect_timeout or settings.connect_timeout,
                                         read_timeout=config.read_timeout or settings.read_timeout,
                                         policies=[CircuitBreaker(config.cooldown)],
                                         transport=config.transport),
                              max_blob_bytes=settings.max_blob_bytes,
                              resolve_max_bytes=settings.resolve_max_bytes, transport=config.transport,
                              insecure_allow_http_presigned=settings.insecure_allow_http_presigned) if url else None
        cache_dir = config.cache_dir if config.cache_dir is not None else settings.cache_dir
        max_bytes = config.cache_max_bytes if config.cache_max_bytes is not None else settings.cache_max_bytes
        self.disk = DiskCache(cache_dir, self.environment, max_bytes=max_bytes,
                              max_age_days=settings.cache_max_age_days)
        self.disk.sweep()
        revalidate = config.revalidate_seconds
        #: What the ladder's steps see of this cache.
        self.context = LoadContext(self.environment, self.trusted_keys, self.insecure_allow_unsigned, backend,
                                   self.disk, self._remote, self.request_deadline,
                                   settings.revalidate_seconds if revalidate is None else revalidate,
                                   index=self._index_source(config, settings))
        self._pid = os.getpid()  # the process this cache belongs to (a forked child makes its own)
        self._memory_hits = 0  # plan()'s hits that did not take the ladder's lock
        self._memory_hits_lock = threading.Lock()
        allowed = MODE_STEPS[self.mode]
        #: The ladder of this cache: ``config.steps`` the mode allows, in order.
        self.steps: list[Step] = [step for step in (make(self.context) for make in config.steps)
                                  if step.builds in allowed]

    @property
    def signatures_checked(self) -> bool:
        """Whether trusted keys are configured, so that a plan's signature can be verified."""
        return len(self.trusted_keys) > 0

    @staticmethod
    def _index_source(config: ClientConfig, settings: ClientSettings) -> IndexSource | None:
        url = config.index_url if config.index_url is not None else settings.index_url
        if not url:
            return None
        from .index import make_source

        sets = config.index_sets if config.index_sets is not None else settings.index_sets
        return make_source(url, sets, connect_timeout=config.connect_timeout or settings.connect_timeout,
                           read_timeout=config.read_timeout or settings.read_timeout, cooldown=config.cooldown,
                           max_blob_bytes=settings.max_blob_bytes, transport=config.transport)

    @property
    def forked(self) -> bool:
        """Whether this is a process forked from the one that made this cache, which cannot use it."""
        return os.getpid() != self._pid

    def _check_process(self) -> None:
        if self.forked:
            raise ForkedProcess(f"this PlanCache was made in process {self._pid}, and process {os.getpid()} is a child "
                                "forked from it: make a PlanCache in the child (a forked process would share the "
                                "parent's locks, threads and server connections, and CUDA does not survive a fork)")

    def _warn_about_keys(self, opt_out: bool) -> None:
        if self.signatures_checked:
            if opt_out:
                log.info("plancache: insecure_allow_unsigned is ignored: trusted keys are configured, so every plan "
                         "must be signed by one of them")
        elif self.mode != "normal":
            log.error("plancache: %s mode admits signed plans only and no trusted keys are configured "
                      "(PLANCACHE_TRUSTED_KEYS or trusted_keys=): every load will raise PlanMiss%s", self.mode,
                      " (insecure_allow_unsigned is ignored in this mode)" if opt_out else "")
        elif self.insecure_allow_unsigned:
            log.warning("plancache: INSECURE: no trusted keys and insecure_allow_unsigned is set: plans from the "
                        "server and the disk cache are checked by size and digest only, so anyone able to alter them "
                        "on the way can run code of their choice on this GPU; such plans are not written to disk")
        else:
            log.warning("plancache: no trusted keys configured (PLANCACHE_TRUSTED_KEYS): plans from the server and the "
                        "disk cache cannot be verified and are refused (no_trusted_keys); every graph is built "
                        "locally. Set PLANCACHE_INSECURE_ALLOW_UNSIGNED=1 only to accept unverifiable plans knowingly")

    # ------------------------------------------------------------ public

    def build(self, graph: Any) -> Plan:
        """``PlanCache.build(graph)`` in place of ``graph.build()``: the caller's own ``cudnn.pygraph``
        (constructed, not built) gets the tuned plan through the ladder and then runs with the caller's
        own ``graph.execute(...)`` (Tensor handles, names or uids). Auto-assigned uids are renumbered to the
        canonical ones (read uids after this call, or assign them). Returns the :class:`Plan`."""
        from ..spec import is_pygraph

        if not is_pygraph(graph):
            raise TypeError(f"build() takes a cudnn.pygraph, not {type(graph).__name__}; use plan() for a spec")
        return self.plan(graph)

    def plan(self, spec: SpecLike) -> Plan:
        """A ready plan for a spec or a caller's pygraph (see the module docstring for the ladder and the modes)."""
        self._check_process()
        p = self._pending(spec)
        if p.graph is None:
            plan = self.context.memory.get(p.key)  # no waiting on the ladder lock while another thread builds
            if plan is not None:
                with self._memory_hits_lock:
                    self._memory_hits += 1
                return plan.named_as(p.spec)
        result = self._load_many([p])[0]
        if isinstance(result, PlanMiss):
            raise result
        return result

    def prefetch(self, specs: Iterable[SpecLike]) -> dict[str, Plan]:
        """Load plans for all specs and pygraphs at start-up: the disk cache first, then one resolve round trip
        for the rest, then local builds as the mode allows. Returns plans by graph key; later :meth:`plan`
        calls of those specs are memory hits (a pygraph is built here, in place). In strict/replay-only mode
        raises :class:`PlanMiss` naming every key without a plan, after loading all the others."""
        batch: list[Pending] = []
        seen: set[str] = set()
        for obj in specs:
            p = self._pending(obj)
            if p.graph is None and p.key in seen:
                continue
            seen.add(p.key)
            batch.append(p)
        if not batch:
            return {}
        results = self._load_many(batch)
        failed = [p for p, r in zip(batch, results) if isinstance(r, PlanMiss)]
        if failed:
            names = ", ".join(f"{p.spec.name or 'unnamed'} ({p.key[:12]})" for p in failed)
            raise PlanMiss(f"{len(failed)} of {len(batch)} graphs have no verified tuned plan on "
                           f"{self.environment.describe()} ({self.mode} mode): {names}")
        return {p.key: r for p, r in zip(batch, results) if isinstance(r, Plan)}

    def warm(self, specs: Iterable[SpecLike]) -> list[str]:
        """Fetch and verify the tuned plans of graphs still to be built (specs, not pygraphs), without loading them:
        the disk cache first, then one resolve round trip for the rest (blobs inline or from where its answer says),
        within ``request_deadline`` and in this host's turn to fetch, like any load. Each verified blob is kept for
        the caller's graph that asks for it later (:meth:`build`, :meth:`serve`), which loads it with no further
        round trip and one deserialization. Builds nothing and never raises :class:`PlanMiss`: a graph without a
        verified plan takes the whole ladder when it is built. Returns the graph keys of ``specs`` kept (also those
        kept before)."""
        from ..spec import graph_key, parse_spec

        wanted = {graph_key(s): s for s in map(parse_spec, specs)}
        batch = [Pending(key, spec, None, warm=True) for key, spec in wanted.items() if key not in self.context.verified]
        if batch:
            self._load_many(batch, frozenset({Builds.NOTHING}))
        return [key for key in wanted if key in self.context.verified]

    def serve(self, graph: Any, spec: GraphSpec, *, max_workspace: int | None = None) -> Plan | None:
        """A tuned plan loaded into the caller's ``graph`` part-way through FE's build pipeline (validated, its
        ``spec`` read before lowering and its auto-assigned uids already canonical): the ladder without local
        builds. A plan needing more than ``max_workspace`` bytes of workspace is refused (``stats().rejects``
        ``workspace``) before it is loaded. On a miss: None in normal mode (the caller's own FE pipeline builds it,
        as it asked), or :class:`PlanMiss` in strict and replay-only mode. This is what :mod:`plancache.client.hook`
        calls."""
        from ..spec import graph_key

        p = Pending(graph_key(spec), spec, graph, max_workspace=max_workspace)
        result = self._load_many([p], SERVING_STEPS[self.mode])[0]
        if isinstance(result, Plan):
            return result
        if self.mode != "normal":
            raise result
        log.info("plancache: %s", result.message)
        return None

    def count_fe_build(self, reason: str) -> None:
        """Count a graph of the process that FE built itself, by why (``stats().fe_builds``)."""
        self._check_process()  # the ladder's lock may be held by a thread of the parent that the child does not have
        self.context.count("fe_builds", reason)

    def _pending(self, obj: SpecLike) -> Pending:
        from ..spec import from_pygraph, graph_key, is_pygraph, parse_spec

        if is_pygraph(obj):
            spec = from_pygraph(obj)
            self._backend.prepare_graph(obj, spec)
            return Pending(graph_key(spec), spec, obj)
        s = parse_spec(obj)
        return Pending(graph_key(s), s, None)

    def stats(self) -> ClientStats:
        """A snapshot of the counters."""
        self._check_process()  # the ladder's lock may be held by a thread of the parent that the child does not have
        with self.context.lock, self._memory_hits_lock:
            s = self.context.stats
            hits = dict(s.hits)
            if self._memory_hits:
                _bump(hits, StepName.MEMORY.value, self._memory_hits)
            return ClientStats(hits, s.misses, dict(s.rejects), dict(s.fallbacks), s.remote_errors,
                               s.remote_skipped, s.load_seconds, s.deserialize_seconds, s.build_seconds,
                               dict(s.fe_builds), dict(s.miss_reasons), dict(s.revalidations), dict(s.withdrawals),
                               dict(s.blob_sources), s.presigned_fallbacks)

    def close(self) -> None:
        """Give the revalidation under way :data:`CLOSE_GRACE_SECONDS`, then abandon its request (the next process
        asks again), finish the disk cache's writes, report the plans this cache refused to the server (one call
        within ``request_deadline``; a failure is logged at debug level), and close the connection to the server. In
        a forked child, nothing: they are the parent's."""
        if self.forked:
            return
        self.context.revalidator.join(min(CLOSE_GRACE_SECONDS, self.request_deadline))
        if self._remote is not None:
            self._remote.http.stop.set()  # waits for answers and retries give up at once
        self.context.revalidator.join(CLOSE_WAIT_SECONDS)
        self.disk.close()
        if self._remote is not None:
            rejects = self.stats().rejects
            if rejects and not self._remote.is_off:
                try:
                    self._remote.report_rejects(rejects, deadline=time.monotonic() + self.request_deadline)
                except PlanCacheError as exc:  # an older server without the route, or none at all: only a figure
                    log.debug("plancache: rejects not reported: %s", exc.message)
            self._remote.close()
        if self.context.index is not None:
            self.context.index.close()

    def __enter__(self) -> PlanCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the ladder

    def _load_many(self, batch: list[Pending], builds: frozenset[Builds] | None = None) -> list[Plan | PlanMiss]:
        """Each step in turn (those that build what ``builds`` allows, default all) for the loads still pending;
        results in the order of ``batch``."""
        self._check_process()
        t0, c = time.perf_counter(), self.context
        with c.lock:
            try:
                plans: dict[Pending, Plan] = {}
                left = batch
                for step in self.steps:
                    if builds is not None and step.builds not in builds:
                        continue
                    if not left:
                        break
                    name, found = str(step.name), step.resolve(left)
                    for p, plan in found.items():
                        if p.graph is None and not p.warm:  # a plan in a caller's own graph is that caller's alone
                            c.memory[p.key] = plan
                        _bump(c.stats.hits, name)
                    plans.update(found)
                    left = [p for p in left if p not in found]
                    if step.builds is not Builds.NOTHING:  # a miss: built, not served
                        c.stats.misses += len(found)
                    if left and step.counts_fallbacks:
                        _bump(c.stats.fallbacks, name, len(left))
                c.stats.misses += len(left)
                return [plans[p] if p in plans else self._miss(p) for p in batch]
            finally:
                for step in self.steps:
                    step.finish()
                c.stats.load_seconds += time.perf_counter() - t0

    def _miss(self, p: Pending) -> PlanMiss:
        hint = "" if self.signatures_checked else (
            f" — {self.mode} mode admits signed plans only and no trusted keys are configured "
            "(PLANCACHE_TRUSTED_KEYS or trusted_keys=)")
        return PlanMiss(f"no verified tuned plan for {p.spec.name or 'graph'} ({p.key}) on "
                        f"{self.environment.describe()} ({self.mode} mode): {'; '.join(p.trail)}{hint}")

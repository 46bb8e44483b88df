"""What the ladder's steps share: the loads on their way down, the counters, and the cache's :class:`LoadContext`.

A load is a :class:`Pending`; a step is of a kind (:class:`Builds`) that a mode allows (:data:`MODE_STEPS`) and has a
name (:class:`StepName`). The server, as the server step and the revalidation see it, is a :class:`RecordsSource`:
:class:`~plancache.client.remote.Remote` over HTTP, or :class:`~plancache.client.records.MemoryRecords` in memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..errors import Reason, VerificationError
from ..verify import verify_blob

if TYPE_CHECKING:
    from ..environment import Environment
    from ..protocol import PlanRecord, ResolveResponse
    from ..signing import TrustedKeys
    from ..spec import GraphSpec
    from .backend import Backend, BuiltPlanLike
    from .cache import DiskCache, FetchLock
    from .index_files import IndexSource
    from .plan import Plan

Mode = Literal["normal", "strict", "replay_only"]


def bump(counter: dict[str, int], key: str, n: int = 1) -> None:
    """Add ``n`` to ``counter[key]``."""
    counter[key] = counter.get(key, 0) + n


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


class RecordsSource(Protocol):
    """Where the server step and the revalidation read records and blobs, register specs and report refusals: the
    server (:class:`~plancache.client.remote.Remote`) or :class:`~plancache.client.records.MemoryRecords`."""

    @property
    def where(self) -> str:
        """Where the records come from, for logs."""

    @property
    def is_off(self) -> bool:
        """Whether calls are held back (a breaker's cool-down)."""

    def resolve(self, environment: Environment, graph_keys: list[str], *, include_blobs: bool = True,
                deadline: float | None = None, background: bool = False) -> ResolveResponse:
        """The records (and blobs) of ``graph_keys``, the keys missing and why each is missing."""

    def fetch_blob(self, sha256: str, *, size: int | None = None, deadline: float | None = None,
                   url: str | None = None, background: bool = False) -> bytes:
        """A blob's bytes, unverified."""

    def register_spec(self, spec: GraphSpec, *, deadline: float | None = None) -> str:
        """Store ``spec`` so an admin can tune it; its graph key."""

    def siblings(self, environment: Environment, graph_keys: list[str], *, limit: int,
                 deadline: float | None = None) -> dict[str, dict[str, Any]]:
        """The specs of the plans held for other shapes of ``graph_keys``, by graph key (:mod:`.siblings`)."""

    def report_rejects(self, rejects: Mapping[str, int], *, deadline: float) -> None:
        """Report the plans this process refused, by reason."""

    def stop(self) -> None:
        """Make waits and retries under way give up at once."""

    def close(self) -> None:
        """Release connections."""


class Revalidation(Protocol):
    """Asks the server again about plans served from disk (:class:`~plancache.client.revalidate.Revalidator`)."""

    def due(self, key: str) -> bool:
        """Whether the entry of ``key``, just loaded from disk, is to be asked about."""

    def schedule(self, keys: list[str]) -> None:
        """Ask about ``keys`` in the background."""

    def join(self, timeout: float | None = None) -> None:
        """Wait for the revalidation under way, at most ``timeout`` seconds."""


class _NoRevalidation:
    def due(self, key: str) -> bool:
        return False

    def schedule(self, keys: list[str]) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


#: The revalidation of a context whose cache set none: nothing is asked again.
NO_REVALIDATION: Revalidation = _NoRevalidation()


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
    were asked of the server's route instead. ``siblings``: plans of other shapes of the graphs loaded, fetched and
    kept ahead of their first call (:mod:`plancache.client.siblings`)."""

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
    siblings: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)




@dataclass(eq=False)
class LoadContext:
    """All that the ladder's steps, and the revalidation of disk entries, use of their :class:`PlanCache` (one per
    cache; a step is made as ``step(context)``).

    :meth:`verify` checks a plan against ``environment``, ``trusted_keys`` (``insecure_allow_unsigned``: normal mode
    without keys admits unsigned plans) and the revisions ``disk`` accepted; :meth:`deserialize` loads one on
    ``backend``, holding ``handle_lock`` (the cuDNN handle, also held by builds and executions). ``stats``: the
    counters, guarded by ``lock`` (held by the ladder; :meth:`count` takes it off the ladder's thread). ``disk``:
    the disk cache; ``remote``: the server or another :class:`RecordsSource` (None: none), each load's exchange
    within ``request_deadline`` seconds. ``memory``: the plans loaded, ``verified``: the blobs admitted (for the
    callers' own graphs), by graph key. ``revalidator`` asks the server about entries loaded from disk last
    confirmed ``revalidate_seconds`` ago (set by the cache that makes the context:
    :class:`~plancache.client.revalidate.Revalidator`; none by default)."""

    environment: Environment
    trusted_keys: TrustedKeys
    insecure_allow_unsigned: bool
    backend: Backend
    disk: DiskCache
    remote: RecordsSource | None
    request_deadline: float
    revalidate_seconds: float
    stats: ClientStats = field(default_factory=ClientStats)
    lock: threading.RLock = field(default_factory=threading.RLock)
    handle_lock: threading.Lock = field(default_factory=threading.Lock)
    memory: dict[str, Plan] = field(default_factory=dict)
    verified: dict[str, tuple[PlanRecord, bytes]] = field(default_factory=dict)
    revalidator: Revalidation = field(default_factory=lambda: NO_REVALIDATION)
    #: This host's turn to fetch the load's missing keys (:meth:`~plancache.client.cache.DiskCache.fetch_lock`), taken
    #: by the disk step.
    fetch_lock: FetchLock | None = None
    #: The static index (:mod:`plancache.client.index`); None: none configured.
    index: IndexSource | None = None

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
            bump(getattr(self.stats, counter), key)


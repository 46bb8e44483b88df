"""``PlanCache``: ready plans for this GPU, through a counted fallback ladder.

For every graph the ladder tries, in order: memory → the local disk cache → the server
(``POST /v1/plans/resolve``) → a rebuild of the tuned record's ``(engine_id, knobs)`` →
a local heuristic build. A blob from disk or server is verified first (size → sha256 →
signature → graph key → environment, see :mod:`plancache.client.verify`) and only then
deserialized; a rejected blob is counted by reason and the ladder goes on. Modes:

- ``normal``: the whole ladder; a plan is always returned (unless the local build itself fails).
- ``strict``: tuned plans only — a verified blob, or the rebuild of an authentic tuned record whose
  blob bytes were damaged; never a heuristic build. Otherwise :class:`~plancache.errors.PlanMiss`.
- ``replay_only``: never builds anything: verified blobs only, :class:`~plancache.errors.PlanMiss` otherwise.

A shape family (the same graph with other dims) shares one cuDNN kernel cache, so the heuristic
build of a further shape of a family reuses the kernels compiled for the first.

The caller's own ``cudnn.pygraph`` goes through the same ladder (:meth:`PlanCache.build`): its spec is
read from FE's IR, its auto-assigned uids are renumbered to the canonical ones, and the tuned plan is
deserialized into it (or built in it), so it then runs with the caller's own ``graph.execute`` call.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from .. import SPEC_SCHEMA_VERSION
from ..environment import Environment
from ..errors import PlanMiss, VerificationError
from ..protocol import PlanRecord, ResolvedPlan, b64decode
from ..settings import Settings, get_settings
from ..signing import TrustedKeys
from ..spec import GraphSpec, canonical_json, from_pygraph, graph_key, is_pygraph, parse_spec
from .backend import Backend, BuiltPlanLike
from .cache import DiskCache
from .plan import Plan
from .remote import Remote, RemoteRefused, RemoteUnavailable
from .verify import check_record, verify_blob

log = logging.getLogger("plancache.client")

Mode = Literal["normal", "strict", "replay_only"]
MODES: tuple[str, ...] = ("normal", "strict", "replay_only")
#: A spec (model, dict or JSON text) or a caller's ``cudnn.pygraph``.
SpecLike = Any
# A load request: (graph key, spec, the caller's pygraph or None).
_Item = tuple[str, GraphSpec, Any]


def family_key(spec: GraphSpec | dict[str, Any] | str | bytes) -> str:
    """The shape family of ``spec``: sha256 of its canonical form with every tensor's dims and strides
    replaced by its rank and its layout order (dimension indices, outermost first)."""
    doc = parse_spec(spec).canonical()
    for t in doc["tensors"]:
        dims, strides = t["dim"] or [], t["stride"] or []
        t["stride"] = sorted(range(len(strides)), key=lambda i: (-strides[i], i))
        t["dim"] = len(dims)
    payload = f"plancache-family/v{SPEC_SCHEMA_VERSION}\n{canonical_json(doc)}"
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass
class ClientStats:
    """What the ladder did. ``hits[source]``: plans returned by source (``memory``, ``disk``, ``server``,
    ``rebuild``, ``heuristic``). ``misses``: loads that found no verified tuned blob. ``rejects[reason]``:
    blobs refused (never deserialized; ``deserialize`` counts verified blobs cuDNN refused to load).
    ``fallbacks[rung]``: times the ladder went past ``disk``, ``server`` or ``rebuild`` to a lower rung.
    ``remote_errors``: failed server requests; ``remote_skipped``: requests not sent because the
    remote was off after a failure. Seconds: ``load`` (inside ``plan``/``prefetch``), ``deserialize``,
    ``build`` (rebuilds and heuristic builds)."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    rejects: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    remote_errors: int = 0
    remote_skipped: int = 0
    load_seconds: float = 0.0
    deserialize_seconds: float = 0.0
    build_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bump(counter: dict[str, int], key: str) -> None:
    counter[key] = counter.get(key, 0) + 1


def _trusted_keys(value: TrustedKeys | str | Iterable[str | Path] | None) -> TrustedKeys:
    if isinstance(value, TrustedKeys):
        return value
    if value is None or isinstance(value, str):
        return TrustedKeys.from_setting(value)
    return TrustedKeys.from_files(list(value))


class PlanCache:
    """Ready cuDNN plans for the GPU of this process, tuned plans first.

    ``server_url``, ``token``, ``trusted_keys``, ``cache_dir`` and the timeouts default to the
    settings (``PLANCACHE_SERVER_URL``, ``PLANCACHE_TOKEN``, ``PLANCACHE_TRUSTED_KEYS``,
    ``PLANCACHE_CACHE_DIR``, ``PLANCACHE_CONNECT_TIMEOUT``/``READ_TIMEOUT``). No server URL (``""``,
    or none configured): disk cache and local builds only. With trusted keys every blob must carry a valid signature by one
    of them; without, only digests are checked (a warning says so). ``backend`` defaults to
    :class:`~plancache.client.backend.GpuBackend` on CUDA device ``device``; ``environment``
    defaults to the backend's fingerprint. After a server failure the server is not asked again
    for ``cooldown`` seconds. Thread-safe: loads run one at a time, but :meth:`plan` of an already loaded
    spec never waits for them (it hashes the spec, so keep the returned :class:`Plan` in hot loops);
    all plans share one cuDNN handle, used by one thread at a time.
    """

    def __init__(self, server_url: str | None = None, *, environment: Environment | None = None,
                 backend: Backend | None = None, trusted_keys: TrustedKeys | str | Iterable[str | Path] | None = None,
                 cache_dir: Path | str | None = None, token: str | None = None, mode: Mode = "normal",
                 cooldown: float = 30.0, connect_timeout: float | None = None, read_timeout: float | None = None,
                 device: int = 0, settings: Settings | None = None, transport: httpx.BaseTransport | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        settings = settings or get_settings()
        self.mode: Mode = mode
        if backend is None:
            from .backend import GpuBackend

            backend = GpuBackend(device)
        self._backend = backend
        self.environment = environment or backend.environment()
        self.trusted_keys = _trusted_keys(trusted_keys if trusted_keys is not None else settings.trusted_keys)
        if not len(self.trusted_keys):
            log.warning("plancache: no trusted keys configured (PLANCACHE_TRUSTED_KEYS): plan signatures are not "
                        "checked, only sizes and digests")
        url = server_url if server_url is not None else settings.server_url
        self._remote = Remote(url, token=token if token is not None else settings.token,
                              connect_timeout=connect_timeout or settings.connect_timeout,
                              read_timeout=read_timeout or settings.read_timeout,
                              cooldown=cooldown, transport=transport) if url else None
        self.disk = DiskCache(cache_dir if cache_dir is not None else settings.cache_dir, self.environment)
        self._lock = threading.RLock()      # the ladder's state
        self._handle_lock = threading.Lock()  # the cuDNN handle: builds, loads and executions
        self._memory: dict[str, Plan] = {}
        self._verified: dict[str, tuple[PlanRecord, bytes]] = {}  # admitted blobs, for the callers' own graphs
        self._kernel_caches: dict[str, Any] = {}
        self._static_families: set[str] = set()
        self._reported: set[str] = set()
        self._may_register = True
        self._stats = ClientStats()
        self._memory_hits = 0
        self._memory_hits_lock = threading.Lock()

    # ------------------------------------------------------------ public

    def build(self, graph: Any) -> Plan:
        """``PlanCache.build(graph)`` in place of ``graph.build()``: the caller's own ``cudnn.pygraph``
        (constructed, not built) gets the tuned plan through the ladder and then runs with the caller's
        own ``graph.execute(...)`` (Tensor handles, names or uids). Auto-assigned uids are renumbered to the
        canonical ones (read uids after this call, or assign them). Returns the :class:`Plan`."""
        if not is_pygraph(graph):
            raise TypeError(f"build() takes a cudnn.pygraph, not {type(graph).__name__}; use plan() for a spec")
        return self.plan(graph)

    def plan(self, spec: SpecLike) -> Plan:
        """A ready plan for a spec or a caller's pygraph (see the module docstring for the ladder and the modes)."""
        item = self._item(spec)
        key, _, graph = item
        if graph is None:
            plan = self._memory.get(key)  # no waiting on the ladder lock while another thread builds
            if plan is not None:
                self._memory_hit()
                return plan
        result = self._load_many([item])[0]
        if isinstance(result, PlanMiss):
            raise result
        return result

    def prefetch(self, specs: Iterable[SpecLike]) -> dict[str, Plan]:
        """Load plans for all specs and pygraphs at start-up: the disk cache first, then one resolve round trip
        for the rest, then local builds as the mode allows. Returns plans by graph key; later :meth:`plan`
        calls of those specs are memory hits (a pygraph is built here, in place). In strict/replay-only mode
        raises :class:`PlanMiss` naming every key without a plan, after loading all the others."""
        items: list[_Item] = []
        seen: set[str] = set()
        for obj in specs:
            item = self._item(obj)
            if item[2] is None and item[0] in seen:
                continue
            seen.add(item[0])
            items.append(item)
        if not items:
            return {}
        results = self._load_many(items)
        failed = [(item, r) for item, r in zip(items, results) if isinstance(r, PlanMiss)]
        if failed:
            names = ", ".join(f"{item[1].name or 'unnamed'} ({item[0][:12]})" for item, _ in failed)
            raise PlanMiss(f"{len(failed)} of {len(items)} graphs have no verified tuned plan on "
                           f"{self.environment.describe()} ({self.mode} mode): {names}")
        return {item[0]: r for item, r in zip(items, results) if isinstance(r, Plan)}

    def _item(self, obj: SpecLike) -> _Item:
        if is_pygraph(obj):
            spec = from_pygraph(obj)
            self._backend.prepare_graph(obj, spec)
            return graph_key(spec), spec, obj
        s = parse_spec(obj)
        return graph_key(s), s, None

    def stats(self) -> ClientStats:
        """A snapshot of the counters."""
        with self._lock, self._memory_hits_lock:
            s = self._stats
            hits = dict(s.hits, memory=self._memory_hits) if self._memory_hits else dict(s.hits)
            return ClientStats(hits, s.misses, dict(s.rejects), dict(s.fallbacks), s.remote_errors,
                               s.remote_skipped, s.load_seconds, s.deserialize_seconds, s.build_seconds)

    def _memory_hit(self) -> None:
        with self._memory_hits_lock:
            self._memory_hits += 1

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> "PlanCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the ladder

    def _load_many(self, items: list[_Item]) -> list[Plan | PlanMiss]:
        """Results in the order of ``items``."""
        t0 = time.perf_counter()
        with self._lock:
            try:
                results: dict[int, Plan | PlanMiss] = {}
                pending: list[tuple[int, PlanRecord | None, list[str]]] = []
                for i, (key, spec, graph) in enumerate(items):
                    plan = self._from_memory(spec, key, graph)
                    if plan is not None:
                        results[i] = plan
                        continue
                    trail: list[str] = []
                    plan, authentic = self._from_disk(spec, key, trail, graph)
                    if plan is not None:
                        results[i] = self._keep(key, plan, graph)
                        continue
                    _bump(self._stats.fallbacks, "disk")
                    pending.append((i, authentic, trail))
                asked = list({items[i][0]: items[i][1] for i, _, _ in pending}.items())
                answers = self._ask(asked) if pending else None
                for i, authentic, trail in pending:
                    key, spec, graph = items[i]
                    try:
                        results[i] = self._keep(key, self._finish(spec, key, authentic, answers, trail, graph), graph)
                    except PlanMiss as exc:
                        results[i] = exc
                return [results[i] for i in range(len(items))]
            finally:
                self._stats.load_seconds += time.perf_counter() - t0

    def _from_memory(self, spec: GraphSpec, key: str, graph: Any) -> Plan | None:
        """A loaded plan, or for a caller's graph the blob admitted earlier in this process, loaded into it."""
        if graph is None:
            plan = self._memory.get(key)
            if plan is not None:
                self._memory_hit()
            return plan
        held = self._verified.get(key)
        if held is None:
            return None
        record, blob = held
        with self._handle_lock:
            built = self._backend.deserialize(spec, blob, engine_id=record.engine_id, knobs=record.knobs,
                                              plan_name=record.plan_name, graph=graph)
        self._memory_hit()
        return self._wrap(spec, key, built, "memory")

    def _keep(self, key: str, plan: Plan, graph: Any) -> Plan:
        if graph is None:  # a plan in a caller's own graph is that caller's; later callers load their own
            self._memory[key] = plan
        _bump(self._stats.hits, plan.source)
        return plan

    def _finish(self, spec: GraphSpec, key: str, authentic: PlanRecord | None,
                answers: dict[str, ResolvedPlan] | None, trail: list[str], graph: Any) -> Plan:
        """The server rung (from the batch answer) and the build rungs."""
        if self._remote is not None:
            if answers is None:
                trail.append("server: unavailable")
            elif key not in answers:
                trail.append("server: no plan for this environment")
            else:
                plan, record = self._from_server(spec, key, answers[key], trail, graph)
                if plan is not None:
                    return plan
                authentic = record or authentic
            _bump(self._stats.fallbacks, "server")
        else:
            trail.append("server: none configured")
        self._stats.misses += 1
        if self.mode == "replay_only":
            raise self._miss(spec, key, trail)
        if authentic is not None:
            plan = self._rebuild(spec, key, authentic, trail, graph)
            if plan is not None:
                return plan
        else:
            trail.append("rebuild: no authentic tuned record")
        _bump(self._stats.fallbacks, "rebuild")
        if self.mode == "strict":
            raise self._miss(spec, key, trail)
        return self._heuristic(spec, key, graph)

    def _miss(self, spec: GraphSpec, key: str, trail: list[str]) -> PlanMiss:
        return PlanMiss(f"no verified tuned plan for {spec.name or 'graph'} ({key}) on {self.environment.describe()} "
                        f"({self.mode} mode): {'; '.join(trail)}")

    def _reject(self, reason: str, where: str, key: str, message: str, trail: list[str]) -> None:
        _bump(self._stats.rejects, reason)
        trail.append(f"{where}: rejected ({reason})")
        log.warning("plancache: rejected the %s plan %s (%s): %s", where, key[:12], reason, message)

    def _admit(self, spec: GraphSpec, key: str, record: PlanRecord, blob: bytes, where: str,
               trail: list[str], graph: Any) -> tuple[Plan | None, PlanRecord | None]:
        """Verify, then deserialize. Returns the plan (or None) and the record when it is authentic."""
        try:
            verify_blob(record, blob, graph_key=key, environment=self.environment, trusted=self.trusted_keys)
        except VerificationError as exc:
            self._reject(exc.reason, where, key, exc.message, trail)
            return None, record if exc.reason in ("size", "sha256") and self._authentic(record, key) else None
        t0 = time.perf_counter()
        try:
            with self._handle_lock:
                built = self._backend.deserialize(spec, blob, engine_id=record.engine_id, knobs=record.knobs,
                                                  plan_name=record.plan_name, graph=graph)
        except Exception as exc:  # noqa: BLE001 - cuDNN refusing a verified blob is a rung failure, not fatal
            self._reject("deserialize", where, key, f"{type(exc).__name__}: {exc}", trail)
            return None, record
        finally:
            self._stats.deserialize_seconds += time.perf_counter() - t0
        self._verified[key] = (record, blob)
        return self._wrap(spec, key, built, where), record

    def _authentic(self, record: PlanRecord, key: str) -> bool:
        try:
            check_record(record, graph_key=key, environment=self.environment, trusted=self.trusted_keys)
        except VerificationError:
            return False
        return True

    def _wrap(self, spec: GraphSpec, key: str, built: BuiltPlanLike, source: str) -> Plan:
        return Plan(spec, key, built, self._backend, source=source, lock=self._handle_lock)

    def _from_disk(self, spec: GraphSpec, key: str, trail: list[str],
                   graph: Any) -> tuple[Plan | None, PlanRecord | None]:
        try:
            entry = self.disk.load(key)
        except VerificationError as exc:
            self._reject(exc.reason, "disk", key, exc.message, trail)
            self.disk.discard(key)
            return None, None
        if entry is None:
            trail.append("disk: no entry")
            return None, None
        record, blob = entry
        plan, authentic = self._admit(spec, key, record, blob, "disk", trail, graph)
        if plan is None:
            self.disk.discard(key, record.blob_sha256)
        return plan, authentic

    def _from_server(self, spec: GraphSpec, key: str, answer: ResolvedPlan, trail: list[str],
                     graph: Any) -> tuple[Plan | None, PlanRecord | None]:
        record = answer.record
        try:
            blob = b64decode(answer.blob_b64) if answer.blob_b64 is not None else self._fetch_blob(record.blob_sha256)
        except ValueError as exc:
            self._reject("malformed", "server", key, str(exc), trail)
            return None, record if self._authentic(record, key) else None
        if blob is None:
            trail.append("server: blob unavailable")
            return None, record if self._authentic(record, key) else None
        plan, authentic = self._admit(spec, key, record, blob, "server", trail, graph)
        if plan is not None:
            self.disk.save(record, blob)
        return plan, authentic

    def _fetch_blob(self, sha256: str) -> bytes | None:
        assert self._remote is not None
        try:
            return self._remote.fetch_blob(sha256)
        except (RemoteUnavailable, RemoteRefused) as exc:
            self._count_remote_failure(exc)
            return None

    def _count_remote_failure(self, exc: RemoteUnavailable | RemoteRefused) -> None:
        if isinstance(exc, RemoteUnavailable) and exc.skipped:
            self._stats.remote_skipped += 1
        else:
            self._stats.remote_errors += 1
            log.warning("plancache: %s", exc.message)

    def _ask(self, items: list[tuple[str, GraphSpec]]) -> dict[str, ResolvedPlan] | None:
        """One resolve for all ``items``; registers the specs of missing keys. None when the server cannot answer."""
        if self._remote is None:
            return None
        try:
            resp = self._remote.resolve(self.environment, [k for k, _ in items], include_blobs=True)
        except (RemoteUnavailable, RemoteRefused) as exc:
            self._count_remote_failure(exc)
            return None
        specs = dict(items)
        for key in resp.missing:
            if key in specs:
                self._report_miss(key, specs[key])
        return resp.plans

    def _report_miss(self, key: str, spec: GraphSpec) -> None:
        """The resolve recorded the miss; store the spec too, once per process, so an admin can tune it."""
        if key in self._reported or not self._may_register or self._remote is None:
            return
        self._reported.add(key)
        try:
            self._remote.register_spec(spec)
        except RemoteRefused as exc:
            if exc.http_status in (401, 403):
                self._may_register = False
                log.info("plancache: this token may not register specs (%s); misses are still recorded by resolve",
                         exc.message)
            else:
                log.warning("plancache: could not register the spec of %s: %s", key[:12], exc.message)
        except RemoteUnavailable as exc:
            self._count_remote_failure(exc)

    def _rebuild(self, spec: GraphSpec, key: str, record: PlanRecord, trail: list[str], graph: Any) -> Plan | None:
        t0 = time.perf_counter()
        try:
            with self._handle_lock:
                built = self._backend.build_engine_config(spec, record.engine_id, record.knobs, graph=graph)
        except Exception as exc:  # noqa: BLE001 - the recorded config may not build here; the next rung decides
            trail.append(f"rebuild: engine {record.engine_id} failed ({type(exc).__name__})")
            log.warning("plancache: rebuilding engine %s of %s failed: %s", record.engine_id, key[:12], exc)
            return None
        finally:
            self._stats.build_seconds += time.perf_counter() - t0
        return self._wrap(spec, key, built, "rebuild")

    def _heuristic(self, spec: GraphSpec, key: str, graph: Any) -> Plan:
        """A local heuristic build, sharing the kernel cache of the spec's shape family (a caller's own graph
        is built as it was made)."""
        family = family_key(spec)
        t0 = time.perf_counter()
        try:
            with self._handle_lock:
                if graph is not None:
                    return self._wrap(spec, key, self._backend.build_heuristic(spec, None, graph=graph), "heuristic")
                if family not in self._static_families:
                    try:
                        cache = self._kernel_caches.get(family)
                        if cache is None:
                            cache = self._kernel_caches[family] = self._backend.create_kernel_cache()
                        return self._wrap(spec, key, self._backend.build_heuristic(spec, cache), "heuristic")
                    except Exception as exc:  # noqa: BLE001 - dynamic shapes unsupported for this graph
                        log.info("plancache: dynamic-shape build of %s failed (%s: %s); building its family statically",
                                 key[:12], type(exc).__name__, exc)
                        self._static_families.add(family)
                        self._kernel_caches.pop(family, None)
                return self._wrap(spec, key, self._backend.build_heuristic(spec, None), "heuristic")
        finally:
            self._stats.build_seconds += time.perf_counter() - t0

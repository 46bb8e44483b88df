"""``PlanCache``: ready plans for this GPU, through a counted fallback ladder.

The ladder (:mod:`plancache.client.ladder`) is a list of steps (:mod:`plancache.client.steps`), tried in order for a
whole batch of loads: memory → the local disk cache → the static index → the server (one
``POST /v1/plans/resolve`` for the batch, :mod:`plancache.client.server_step`) → a rebuild of the tuned record's
``(engine_id, knobs)`` → a local heuristic build. A blob from disk or server is verified first (size → sha256 →
signature → graph key → environment → revision, see :mod:`plancache.verify`) and only then deserialized; a
rejected blob is counted by reason and the ladder goes on. A mode is the kinds of step it allows
(:data:`~plancache.client.context.MODE_STEPS`, by :class:`~plancache.client.context.Builds`):

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
(:mod:`plancache.client.remote`, the one module that talks to it). Past either, the server counts as failed for
that load and its breaker opens.

The caller's own ``cudnn.pygraph`` goes through the same ladder (:meth:`PlanCache.build`): its spec is
read from FE's IR, its auto-assigned uids are renumbered to the canonical ones, and the tuned plan is
deserialized into it (or built in it), so it then runs with the caller's own ``graph.execute`` call.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import ForkedProcess, PlanCacheError, PlanMiss
from .backend import Backend
from .context import MODES, SERVING_STEPS, Builds, ClientStats, LoadContext, Mode, Pending, RecordsSource, StepName, bump
from .ladder import LADDER, Ladder, StepFactory
from .plan import Plan

if TYPE_CHECKING:  # imported by the first PlanCache made, not with this module (plancache.client's docstring)
    import httpx

    from ..environment import Environment
    from ..protocol import PlanRecord
    from ..settings import ClientSettings
    from ..signing import TrustedKeys
    from ..spec import GraphSpec
    from .index_files import IndexSource
    from .steps import Step

log = logging.getLogger("plancache.client")

#: A spec (model, dict or JSON text) or a caller's ``cudnn.pygraph``.
SpecLike = Any
#: Seconds :meth:`PlanCache.close` gives the revalidation under way to end (a server that answers does so in
#: milliseconds), and then, its request abandoned, to write what it has.
CLOSE_GRACE_SECONDS, CLOSE_WAIT_SECONDS = 1.0, 0.5


class VerifiedBlob(NamedTuple):
    """A plan's verified blob, kept by the cache (:meth:`PlanCache.verified_blobs`): its record, its bytes, and
    the step it came from (``memory`` when kept from before)."""

    record: PlanRecord
    blob: bytes
    source: str


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
    :mod:`plancache.client.index`), ``index_sets`` ``PLANCACHE_INDEX_SETS`` (its named sets read first),
    ``prefetch_siblings`` ``PLANCACHE_PREFETCH_SIBLINGS`` (plans of other shapes of the graphs loaded fetched ahead,
    at most this many per graph; 0: never: :mod:`plancache.client.siblings`). After a server failure
    the server is not asked again for ``cooldown`` seconds. ``backend`` defaults to
    :class:`~plancache.client.backend.GpuBackend` on CUDA device ``device``; ``environment`` to the backend's
    fingerprint. ``steps``: the ladder, before the mode filters it. ``records``: where the server step reads records
    and blobs in place of ``server_url`` (:class:`~plancache.client.records.MemoryRecords`: a ladder without a
    network)."""

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
    prefetch_siblings: int | None = None
    environment: Environment | None = None
    backend: Backend | None = None
    device: int = 0
    settings: ClientSettings | None = None
    transport: httpx.BaseTransport | None = None
    steps: tuple[StepFactory, ...] = LADDER
    records: RecordsSource | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.request_deadline is not None and self.request_deadline <= 0:
            raise ValueError("request_deadline must be > 0")
        if self.revalidate_seconds is not None and self.revalidate_seconds < 0:
            raise ValueError("revalidate_seconds must be >= 0")
        if self.prefetch_siblings is not None:
            from ..protocol import MAX_SIBLINGS

            if not 0 <= self.prefetch_siblings <= MAX_SIBLINGS:
                raise ValueError(f"prefetch_siblings must be from 0 to {MAX_SIBLINGS}")



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
        from ..settings import ClientSettings
        from .cache import DiskCache
        from .remote import connect
        from .revalidate import Revalidator
        from .siblings import Siblings

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
        token = config.token if config.token is not None else settings.token
        self._remote = config.records or (connect(url, token, settings, connect_timeout=config.connect_timeout,
                                                  read_timeout=config.read_timeout, cooldown=config.cooldown,
                                                  transport=config.transport) if url else None)
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
        self.context.revalidator = Revalidator(self.context, self.context.revalidate_seconds)
        siblings = config.prefetch_siblings
        #: Fetches the plans of other shapes of the graphs loaded (:mod:`plancache.client.siblings`).
        self.siblings = Siblings(self.context, settings.prefetch_siblings if siblings is None else siblings, self.warm)
        self._pid = os.getpid()  # the process this cache belongs to (a forked child makes its own)
        self._memory_hits = 0  # plan()'s hits that did not take the ladder's lock
        self._memory_hits_lock = threading.Lock()
        #: The ladder of this cache: ``config.steps`` the mode allows, in order.
        self.ladder = Ladder(self.context, config.steps, self.mode)

    @property
    def steps(self) -> list[Step]:
        """The steps of this cache's ladder, in order."""
        return self.ladder.steps

    @property
    def signatures_checked(self) -> bool:
        """Whether trusted keys are configured, so that a plan's signature can be verified."""
        return len(self.trusted_keys) > 0

    @staticmethod
    def _index_source(config: ClientConfig, settings: ClientSettings) -> IndexSource | None:
        url = config.index_url if config.index_url is not None else settings.index_url
        if not url:
            return None
        from .index_files import make_source

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

    def warm(self, specs: Iterable[SpecLike], *, load: Collection[str] = frozenset()) -> list[str]:
        """Fetch and verify the tuned plans of graphs still to be built (specs, not pygraphs), without loading them:
        the disk cache first, then one resolve round trip for the rest (blobs inline or from where its answer says),
        within ``request_deadline`` and in this host's turn to fetch, like any load. Each verified blob is kept for
        the caller's graph that asks for it later (:meth:`build`, :meth:`serve`), which loads it with no further
        round trip and one deserialization. ``load``: graph keys whose plans are deserialized now as well, each into
        an empty graph of its own, as :meth:`plan` loads a spec (for graphs that run from that loaded graph, as the
        attention route's do: their first :meth:`plan` is a memory hit). Builds nothing and never raises
        :class:`PlanMiss`: a graph without a verified plan takes the whole ladder when it is built. Returns the
        graph keys of ``specs`` kept (also those kept or loaded before)."""
        from ..spec import graph_key, parse_spec

        c = self.context
        wanted = {graph_key(s): s for s in map(parse_spec, specs)}
        batch = [Pending(key, spec, None, warm=key not in load) for key, spec in wanted.items()
                 if (key not in c.memory if key in load else key not in c.verified)]
        if batch:
            self._load_many(batch, frozenset({Builds.NOTHING}))
        return [key for key in wanted if key in c.verified or key in c.memory]

    def verified_blobs(self, specs: Iterable[SpecLike]) -> dict[str, VerifiedBlob]:
        """The verified blobs of ``specs``, for a caller that loads plans itself (the attention route's C++ steady
        path): fetched as :meth:`warm` fetches them (nothing built, never :class:`PlanMiss`), or kept from before and
        verified again now (a withdrawal or a newer revision since refuses it; a ``memory`` hit), by graph key; a spec
        without one is left out. The caller counts its loading time with :meth:`count_load`."""
        from ..errors import VerificationError
        from ..spec import graph_key, parse_spec

        c = self.context
        wanted = {graph_key(s): s for s in map(parse_spec, specs)}
        batch = [Pending(key, spec, None, warm=True) for key, spec in wanted.items() if key not in c.verified]
        sources = {}
        if batch:
            for p, result in zip(batch, self._load_many(batch, frozenset({Builds.NOTHING}))):
                if isinstance(result, Plan):
                    sources[p.key] = result.source
        found = {}
        for key in wanted:
            held = c.verified.get(key)
            if held is None:
                continue
            if key not in sources:
                try:
                    c.verify(*held, key)
                except VerificationError as exc:
                    c.verified.pop(key, None)
                    c.count("rejects", exc.reason)
                    log.warning("plancache: the kept plan %s is refused now (%s): %s", key[:12], exc.reason, exc.message)
                    continue
                c.count("hits", StepName.MEMORY.value)
            found[key] = VerifiedBlob(*held, sources.get(key, StepName.MEMORY.value))
        return found

    def count_load(self, seconds: float) -> None:
        """Count ``seconds`` a caller spent deserializing blobs of :meth:`verified_blobs` (``stats().deserialize_seconds``)."""
        with self.context.lock:
            self.context.stats.deserialize_seconds += seconds

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
                bump(hits, StepName.MEMORY.value, self._memory_hits)
            return ClientStats(hits, s.misses, dict(s.rejects), dict(s.fallbacks), s.remote_errors,
                               s.remote_skipped, s.load_seconds, s.deserialize_seconds, s.build_seconds,
                               dict(s.fe_builds), dict(s.miss_reasons), dict(s.revalidations), dict(s.withdrawals),
                               dict(s.blob_sources), s.presigned_fallbacks, s.siblings)

    def close(self) -> None:
        """Give the revalidation under way :data:`CLOSE_GRACE_SECONDS`, then abandon its request (the next process
        asks again), finish the disk cache's writes, report the plans this cache refused to the server (one call
        within ``request_deadline``; a failure is logged at debug level), and close the connection to the server. In
        a forked child, nothing: they are the parent's."""
        if self.forked:
            return
        for background in (self.context.revalidator, self.siblings):
            background.join(min(CLOSE_GRACE_SECONDS, self.request_deadline))
        if self._remote is not None:
            self._remote.stop()  # waits for answers and retries give up at once
        for background in (self.context.revalidator, self.siblings):
            background.join(CLOSE_WAIT_SECONDS)
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

    def _load_many(self, batch: list[Pending], builds: frozenset[Builds] | None = None) -> list[Plan | PlanMiss]:
        self._check_process()
        results = self.ladder.load(batch, builds)
        # plans the server gave: those of their other shapes are fetched ahead (one served from disk asks nothing: the
        # process that fetched it fetched its siblings into the same disk cache)
        self.siblings.offer(p.spec for p, r in zip(batch, results) if isinstance(r, Plan) and r.source == StepName.SERVER)
        return results

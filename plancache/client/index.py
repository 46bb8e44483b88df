"""The signed static index as a rung of the client's ladder: records and blobs by plain GETs, no API call.

With ``PLANCACHE_INDEX_URL`` (``index_url=``) set to the root of a published index (:mod:`plancache.index`: a
bucket's public URL, a CDN in front of it, or a ``file://`` folder), :class:`IndexStep` runs after the disk cache and
before the server: it reads the environment's signed root, the shards of the keys it is asked for and their blobs,
each a GET that any HTTP cache can serve (the blobs and shards are named by their sha256, so they never change). A
key the index lacks goes on to the server, which records the miss, registers the spec and explains it, as without
an index.

Verification is the server path's: the root by :func:`plancache.index.open_root` (a trusted key's signature, this
environment, not expired, its version not below the highest one this host accepted: that version is kept in the disk
cache as the revision of :data:`INDEX_VERSION_KEY`, so a replayed older root is refused by every later process), each
shard by its sha256 in the root, then each record and blob as any other (:meth:`Step.admit`: size, sha256, signature,
graph key, environment, revision). Everything is read within the cache's ``request_deadline`` and with a size limit.
A verified root is used again for :data:`ROOT_REFRESH_SECONDS` (its expiry still checked), and one refused or
unreadable is not asked for again that long (its loads go on to the server); shards are kept by digest.

``PLANCACHE_INDEX_SETS`` (``index_sets=``) names sets published with the index (``plancache index publish --set``,
e.g. a model's graphs): their shards are read first, whatever keys are asked for, so the start-up of a process whose
graphs are in its sets reads the root and those shards only; any other key is looked up in its prefix shard.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, TypeVar

from ..errors import PlanCacheError, ServerUnavailable, VerificationError
from .context import StepName, bump
from .steps import FETCH_THREADS, StoreStep

if TYPE_CHECKING:

    from ..blobs import BlobReader
    from ..index import IndexRoot, IndexShard, ShardRef
    from ..protocol import PlanRecord
    from .context import LoadContext, Pending

log = logging.getLogger("plancache.client")
T = TypeVar("T")

#: The graph key under which the disk cache keeps the highest index version accepted (its revision slot): the sha256
#: of a text no spec hashes to.
INDEX_VERSION_KEY = hashlib.sha256(b"plancache index version").hexdigest()
#: Seconds a verified root is used again before it is read again.
ROOT_REFRESH_SECONDS = 60.0
#: Bytes of shards kept in memory (by digest), the oldest forgotten first.
SHARD_MEMORY_BYTES = 32 << 20


class IndexStep(StoreStep):
    """The static index (see the module docstring); without an index configured it passes every load on, silently."""

    name = StepName.INDEX

    def __init__(self, context: LoadContext) -> None:
        super().__init__(context)
        self.counts_fallbacks = context.index is not None
        self._root: tuple[IndexRoot, float] | None = None  # the verified root and when it was read (monotonic)
        self._down: tuple[str, float] | None = None  # why the last root was refused or unreadable, and when
        self._shards: dict[str, dict[str, PlanRecord]] = {}  # shard sha256: its records by graph key
        self._shard_bytes: dict[str, int] = {}  # shard sha256: its size

    def entries(self, batch: list[Pending]) -> tuple[dict[Pending, PlanRecord], BlobReader]:
        from .received import ReceivedBlobs

        c, source = self.context, self.context.index
        records: dict[Pending, PlanRecord] = {}
        received = ReceivedBlobs("the index" if source is None else source.url)
        if source is None:
            return records, received
        now = time.monotonic()
        if self._down is not None and now - self._down[1] < ROOT_REFRESH_SECONDS:  # not asked again for a while
            return self._passed(batch, self._down[0]), received
        try:
            root = self._verified_root(now + c.request_deadline)
        except VerificationError as exc:
            bump(c.stats.rejects, exc.reason)
            log.warning("plancache: refused the index at %s (%s): %s", source.url, exc.reason, exc.message)
            self._down = (f"index refused ({exc.reason}): {exc.message}", now)
            return self._passed(batch, self._down[0]), received
        except PlanCacheError as exc:
            c.stats.remote_errors += 1
            log.warning("plancache: the index at %s is unavailable: %s", source.url, exc.message)
            self._down = ("unavailable", now)
            return self._passed(batch, self._down[0]), received
        self._down = None
        deadline = now + c.request_deadline
        if root is None:
            return self._passed(batch, "no index published for this environment"), received
        found = self._records(root, batch, deadline)
        blobs = self._blobs(found, deadline)
        for p, record in found.items():
            if (blob := blobs.get(p)) is not None:
                records[p] = record
                received.add(record.blob_sha256, blob)
        return records, received

    def kept(self, p: Pending, record: PlanRecord, blob: bytes) -> None:
        c = self.context
        if c.signatures_checked:  # an unsigned plan is used, never kept
            c.disk.save_later(record, blob)

    def _passed(self, batch: list[Pending], why: str) -> dict[Pending, PlanRecord]:
        for p in batch:
            p.note(self.name, why)
        return {}

    def _verified_root(self, deadline: float) -> IndexRoot | None:
        """The environment's root, verified (read again past :data:`ROOT_REFRESH_SECONDS`); None when none is
        published. Raises VerificationError when it is refused, another PlanCacheError when it cannot be read."""
        from ..index import MAX_ROOT_BYTES, open_root, root_path

        c = self.context
        assert c.index is not None
        now = datetime.now(UTC)
        if self._root is not None:
            root, read_at = self._root
            if time.monotonic() - read_at < ROOT_REFRESH_SECONDS and root.header.expires > now:
                return root
        data = c.index.get(root_path(c.environment.env_id), MAX_ROOT_BYTES, deadline)
        if data is None:
            return None
        root = open_root(data, c.trusted_keys, c.environment, min_version=c.disk.revision(INDEX_VERSION_KEY),
                         now=now, what=f"index root {c.index.url}/{root_path(c.environment.env_id)}")
        c.disk.accept_revision(INDEX_VERSION_KEY, root.header.version)
        self._root = (root, time.monotonic())
        return root

    def _records(self, root: IndexRoot, batch: list[Pending], deadline: float) -> dict[Pending, PlanRecord]:
        """The records the index holds for ``batch`` (their shards read and checked; the others noted): from the
        named sets first, then by prefix."""
        assert self.context.index is not None
        named = [ref for name in self.context.index.sets if (ref := root.set_named(name)) is not None]
        failed = self._read_shards(root, named, deadline)
        in_sets = {}
        for ref in named:
            in_sets.update(self._shards.get(ref.sha256, {}))
        refs = {p: None if p.key in in_sets else root.shard_for(p.key) for p in batch}
        failed.update(self._read_shards(root, [ref for ref in refs.values() if ref is not None], deadline))
        found: dict[Pending, PlanRecord] = {}
        for p, ref in refs.items():
            record = in_sets.get(p.key) or (None if ref is None else self._shards.get(ref.sha256, {}).get(p.key))
            if record is not None:
                found[p] = record
            elif ref is not None and ref.sha256 in failed:
                p.note(self.name, failed[ref.sha256])
            else:
                p.note(self.name, "not in the index")
        return found

    def _read_shards(self, root: IndexRoot, refs: list[ShardRef], deadline: float) -> dict[str, str]:
        """Read and check the shards of ``refs`` not held yet, at once; why each one that failed did, by digest."""
        wanted = {ref.sha256: ref for ref in refs if ref.sha256 not in self._shards}
        failed: dict[str, str] = {}
        for sha, result in zip(wanted, self._fetch_all([partial(self._shard, root, ref, deadline)
                                                        for ref in wanted.values()]), strict=True):
            if isinstance(result, PlanCacheError):
                failed[sha] = (f"shard refused ({result.reason})" if isinstance(result, VerificationError)
                               else "shard unavailable")
                log.warning("plancache: index shard %s: %s", sha[:12], result.message)
            else:
                while self._shards and sum(self._shard_bytes.values()) + wanted[sha].size > SHARD_MEMORY_BYTES:
                    oldest = next(iter(self._shards))
                    del self._shards[oldest], self._shard_bytes[oldest]
                self._shards[sha] = {r.graph_key: r for r in result.plans}
                self._shard_bytes[sha] = wanted[sha].size
        return failed

    def _shard(self, root: IndexRoot, ref: ShardRef, deadline: float) -> IndexShard | PlanCacheError:
        from ..index import open_shard, shard_path

        assert self.context.index is not None
        try:
            data = self.context.index.get(shard_path(root.header.env_id, ref.sha256), ref.size, deadline)
            if data is None:
                return ServerUnavailable(f"shard {ref.sha256} named by the root is not there")
            return open_shard(data, ref, root)
        except PlanCacheError as exc:
            return exc

    def _blobs(self, found: dict[Pending, PlanRecord], deadline: float) -> dict[Pending, bytes]:
        """The blobs of the records that could be admitted (the record alone checked first: no download otherwise),
        each at most its record's size; the others refused or noted."""
        from ..blobs.base import shard

        c = self.context
        assert c.index is not None
        source = c.index
        todo: list[tuple[Pending, PlanRecord]] = []
        for p, record in found.items():
            try:
                c.verify(record, None, p.key)
            except VerificationError as exc:
                self.reject(p, exc.reason, exc.message)
                continue
            todo.append((p, record))

        def get(record: PlanRecord) -> bytes | PlanCacheError | None:
            try:
                return source.get(shard(record.blob_sha256), min(record.blob_size, source.max_blob_bytes), deadline)
            except PlanCacheError as exc:
                return exc

        blobs: dict[Pending, bytes] = {}
        for (p, record), blob in zip(todo, self._fetch_all([partial(get, r) for _, r in todo]), strict=True):
            if isinstance(blob, bytes):
                bump(c.stats.blob_sources, "index")
                blobs[p] = blob
            else:
                p.note(self.name, "no blob" if blob is None else "blob unavailable")
                if blob is not None:
                    log.warning("plancache: index blob %s: %s", record.blob_sha256[:12], blob.message)
                self.learn(p, record)
        return blobs

    @staticmethod
    def _fetch_all(calls: list[Callable[[], T]]) -> list[T]:
        """``calls`` run, :data:`~plancache.client.core.FETCH_THREADS` at a time; their results in order."""
        if len(calls) <= 1:
            return [call() for call in calls]
        try:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(calls)), thread_name_prefix="plancache-index") as pool:
                return list(pool.map(lambda call: call(), calls))
        except RuntimeError:  # the interpreter is exiting (no new threads): one at a time, on this thread
            return [call() for call in calls]

"""The server as a rung of the ladder: one resolve round trip for a batch, its blobs, its misses registered.

A miss costs at most two round trips: the resolve, whose answer says why each missing key is missing, then the
registration of the spec of a key the server has never seen (:class:`~plancache.client.remote.Registrar`). Every
call and its policy is :mod:`plancache.client.remote`'s; this step decides what to ask and what to keep.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING

from ..errors import PlanCacheError, Reason, ServerUnavailable, VerificationError
from .context import LoadContext, Pending, RecordsSource, StepName, bump
from .remote import Missed, MissMemory, Registrar
from .revalidate import apply_withdrawal
from .steps import FETCH_THREADS, StoreStep

if TYPE_CHECKING:
    from ..blobs import BlobReader
    from ..protocol import PlanRecord, ResolvedPlan, ResolveResponse
    from ..spec import GraphSpec
    from .plan import Plan

log = logging.getLogger("plancache.client")


class ServerStep(StoreStep):
    """One resolve round trip for the batch, blobs inline or fetched from where the answer says (a presigned
    object-store URL, without the token, or the server's route), all of it within the cache's
    ``request_deadline`` and each answer within its size limit; a verified blob whose signature was checked is
    saved to disk. The specs of the keys the server has never seen are registered (:attr:`registrar`), so an admin
    can tune them; a key it missed is not asked about again for a while (:attr:`missed`)."""

    name = StepName.SERVER

    def __init__(self, context: LoadContext) -> None:
        super().__init__(context)
        self.counts_fallbacks = context.remote is not None
        self.registrar = Registrar(self._count_failure)
        self.missed = MissMemory()  # steps run under the context's lock: no lock of its own

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        try:
            return super().resolve(batch)
        finally:  # what it fetched is queued for the disk: the processes waiting need not wait for local builds
            self.context.release_fetch_lock()

    def entries(self, batch: list[Pending]) -> tuple[dict[Pending, PlanRecord], BlobReader]:
        """The records the server resolves for ``batch``, with the blobs received for them (the misses noted with
        their reasons, withdrawals applied, specs registered)."""
        from .received import ReceivedBlobs

        c = self.context
        records: dict[Pending, PlanRecord] = {}
        received = ReceivedBlobs("the server" if c.remote is None else c.remote.where)
        if c.remote is None:
            for p in batch:
                p.note(self.name, "none configured")
            return records, received
        now = time.monotonic()
        deadline = now + c.request_deadline
        known = {p.key: m for p in batch if (m := self.missed.get(p.key)) is not None}
        specs = {p.key: p.spec for p in batch if p.key not in known}
        answer = self._ask(specs, deadline) if specs else None
        answers = answer.plans if answer is not None else (None if specs else {})  # None: no answer
        fresh = [k for k in specs if answers is not None and k not in answers]  # listed missing, or left out
        reasons = {k: r for k, r in answer.reasons.items() if k in specs} if answer is not None else {}
        blobs = self._blobs([(p, answers[p.key]) for p in batch if answers and p.key in answers], deadline)
        for key in fresh:
            reason = reasons.get(key)
            unregistered = None
            if reason is None or reason.reason == "not_registered":
                unregistered = self.registrar.register(c.remote, key, specs[key], deadline)
            known[key] = Missed(now, reason, unregistered)
            self.missed.remember(key, known[key])
        for p in batch:
            if p.key in known:
                self._note_miss(p, known[p.key], now, fresh=p.key in specs)
            elif answers is None:
                p.note(self.name, "unavailable")
            elif (blob := blobs[p]) is not None:  # else refused or not downloaded, and noted so
                records[p] = answers[p.key].record
                received.add(records[p].blob_sha256, blob)
        for key, reason in reasons.items():
            if reason.withdrawal is not None:
                apply_withdrawal(c, key, reason.withdrawal)
        return records, received

    def _note_miss(self, p: Pending, missed: Missed, now: float, *, fresh: bool) -> None:
        """Note and count why the server has no plan for ``p``: its reason as the server gave it, and why its spec
        was not registered, if so."""
        reason, ago = missed.reason, "" if fresh else f" {now - missed.at:.0f} s ago"
        why = reason.message if reason else "none for this environment"
        note = f"no plan{ago}: {why}" if reason or ago else "no plan for this environment"
        if missed.unregistered is not None:
            note += f"; its spec was not registered: {missed.unregistered}"
        p.note(self.name, note)
        bump(self.context.stats.miss_reasons, reason.reason if reason else "unexplained")

    def kept(self, p: Pending, record: PlanRecord, blob: bytes) -> None:
        c = self.context
        if c.signatures_checked:  # an unsigned plan is used, never kept
            c.disk.save_later(record, blob)  # written after the plans are ready

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
                bump(stats.blob_sources, source)
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
        bump(self.context.stats.blob_sources, "inline")
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

    def _remote(self) -> RecordsSource:
        assert self.context.remote is not None
        return self.context.remote

    def _count_failure(self, exc: PlanCacheError) -> None:
        stats = self.context.stats
        if isinstance(exc, ServerUnavailable) and exc.skipped:
            stats.remote_skipped += 1
        else:
            stats.remote_errors += 1
            log.warning("plancache: %s", exc.message)

    def _ask(self, specs: dict[str, GraphSpec], deadline: float) -> ResolveResponse | None:
        """One resolve for all keys of ``specs`` (None: no answer). Without a way to check signatures, only records
        are asked for (they are refused all the same)."""
        c = self.context
        try:
            return self._remote().resolve(c.environment, list(specs), include_blobs=c.signatures_checked or
                                          c.insecure_allow_unsigned, deadline=deadline)
        except PlanCacheError as exc:
            self._count_failure(exc)
            return None

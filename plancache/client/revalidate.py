"""Bounded staleness of the disk cache: plans loaded from disk are asked about again, off the load's path.

A plan from the disk cache is served at once. When the server last gave or confirmed its entry longer ago than
``revalidate_seconds`` (``PLANCACHE_REVALIDATE_SECONDS``; :meth:`~plancache.client.cache.DiskCache.checked_at`),
its key is asked about on a background thread once the load is done, once per key and process: one records-only
resolve for the keys due, whose answer says why the server no longer has a key (a withdrawal, signed).

- The same record: the entry is marked confirmed.
- A newer record (a replacement): its blob is fetched and verified as a load verifies it, replaces the entry and
  raises the revision floor (the older plan is refused from then on).
- A withdrawal that verifies by a trusted key and is newer than the entry (:func:`apply_withdrawal`): the entry is
  deleted and the revision floor raised to the withdrawal's, so the withdrawn plan is refused from then on.
- Anything else (no answer in time, an older or unverifiable record or withdrawal, a miss without a withdrawal):
  the entry stays, unconfirmed, and the next process asks again.

What changes takes effect at the next load from disk, i.e. in the next process (or :class:`PlanCache`), and at
once for a blob this process admitted but has not loaded yet (a warm start's, or one kept for the callers' own
graphs): it is not loaded into another graph. A plan already deserialized in this process keeps running in it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..errors import PlanCacheError, VerificationError
from ..verify import verify_withdrawal
from .background import Background

if TYPE_CHECKING:
    from ..protocol import PlanRecord, Withdrawal
    from .context import LoadContext

log = logging.getLogger("plancache.client")

#: What revalidating one key did (keys of ``stats().revalidations``).
OUTCOMES: tuple[str, ...] = ("current", "replaced", "withdrawn", "kept", "failed")


def apply_withdrawal(context: LoadContext, key: str, withdrawal: Withdrawal) -> bool:
    """Act on a withdrawal of the plan of ``key`` the server gave: when it verifies (signed by a trusted key, for this
    graph and GPU) and its revision is above every revision the disk cache knows for the key, delete the entry and
    raise the revision floor to it. Counted in ``stats().withdrawals`` (``applied``, ``not_newer``, or the reason it was
    refused); returns whether it was applied."""
    what = f"withdrawal of plan {key[:12]}"
    try:
        verify_withdrawal(withdrawal, what=what, trusted=context.trusted_keys, graph_key=key,
                          environment=context.environment)
    except VerificationError as exc:
        log.warning("plancache: ignored the %s (%s): %s", what, exc.reason, exc.message)
        context.count("withdrawals", exc.reason)
        return False
    disk = context.disk
    try:
        record = disk.record(key)
    except VerificationError:
        record = None
    known = max(disk.revision(key), record.revision if record else 0)
    if withdrawal.revision <= known:
        log.info("plancache: ignored the %s: its revision %d is not above revision %d known here", what,
                 withdrawal.revision, known)
        context.count("withdrawals", "not_newer")
        return False
    disk.discard(key, record.blob_sha256 if record else None)
    disk.accept_revision(key, withdrawal.revision, background=False)
    context.verified.pop(key, None)  # a blob admitted earlier is not loaded into another graph
    log.warning("plancache: the plan %s for this GPU was withdrawn (revision %d): %s; it will not be loaded again",
                key[:12], withdrawal.withdrawn_revision, withdrawal.reason)
    context.count("withdrawals", "applied")
    return True


class Revalidator:
    """Asks the server about plans loaded from ``context``'s disk cache, on one background thread (see the module
    docstring). ``max_age``: seconds since the server last confirmed an entry past which it is asked about."""

    def __init__(self, context: LoadContext, max_age: float) -> None:
        if max_age < 0:
            raise ValueError("revalidate_seconds must be >= 0")
        self.context = context
        self.max_age = max_age
        self._asked: set[str] = set()
        self._lock = threading.Lock()
        self._background = Background("plancache-revalidate", self.revalidate, "revalidating plans")

    def due(self, key: str) -> bool:
        """Whether the entry of ``key``, just loaded from disk, is to be asked about."""
        if self.context.remote is None or key in self._asked:
            return False
        checked = self.context.disk.checked_at(key)
        return checked is None or time.time() - checked >= self.max_age

    def schedule(self, keys: list[str]) -> None:
        """Ask about ``keys`` on the background thread (started when none runs); a key once per process."""
        with self._lock:
            keys = [k for k in dict.fromkeys(keys) if k not in self._asked]
            self._asked.update(keys)
        self._background.put(keys)  # dropped at interpreter exit: the next process asks

    def join(self, timeout: float | None = None) -> None:
        """Wait for the revalidation under way, if any (at most ``timeout`` seconds)."""
        self._background.join(timeout)

    def revalidate(self, keys: list[str]) -> None:
        """Ask the server about ``keys`` and act on the answers, within the cache's ``request_deadline``."""
        c = self.context
        assert c.remote is not None
        deadline = time.monotonic() + c.request_deadline
        try:
            answer = c.remote.resolve(c.environment, keys, include_blobs=False, deadline=deadline, background=True)
        except PlanCacheError as exc:
            log.info("plancache: could not revalidate %d plans from the disk cache: %s", len(keys), exc.message)
            for _ in keys:
                c.count("revalidations", "failed")
            return
        for key in keys:
            resolved, reason = answer.plans.get(key), answer.reasons.get(key)
            if resolved is not None:
                outcome = self._compare(key, resolved.record, deadline)
            elif reason is not None and reason.withdrawal is not None:
                outcome = "withdrawn" if apply_withdrawal(c, key, reason.withdrawal) else "kept"
            else:
                outcome = "kept"
            c.count("revalidations", outcome)

    def _compare(self, key: str, record: PlanRecord, deadline: float) -> str:
        """The server's record of ``key`` against the disk entry: confirm it, or replace it by a newer one."""
        c = self.context
        try:
            have = c.disk.record(key)
        except VerificationError:
            have = None
        if have is None:  # deleted meanwhile: the next load asks the server itself
            return "kept"
        if record.revision == have.revision and record.blob_sha256 == have.blob_sha256:
            c.disk.mark_checked(key)
            return "current"
        if record.revision < have.revision:
            log.info("plancache: the server's plan %s has revision %d, older than the cached %d; kept the cached one",
                     key[:12], record.revision, have.revision)
            return "kept"
        assert c.remote is not None
        try:
            c.verify(record, None, key, signed=True)  # no download for a record that cannot be admitted
            blob = c.remote.fetch_blob(record.blob_sha256, size=record.blob_size, deadline=deadline, background=True)
            c.verify(record, blob, key, signed=True)
        except VerificationError as exc:
            log.warning("plancache: refused the server's newer plan %s (%s): %s", key[:12], exc.reason, exc.message)
            c.count("rejects", exc.reason)
            return "kept"
        except PlanCacheError as exc:
            log.info("plancache: could not fetch the newer plan %s: %s", key[:12], exc.message)
            return "failed"
        c.disk.save(record, blob, checked=True)
        c.disk.accept_revision(key, record.revision, background=False)
        c.verified.pop(key, None)  # the next graph loads the new one
        log.info("plancache: the plan %s was replaced on the server (revision %d → %d); the disk cache has the new "
                 "one from the next load", key[:12], have.revision, record.revision)
        return "replaced"

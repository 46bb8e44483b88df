"""The client's local disk cache of verified plans, so a process with no network starts from it.

Layout, per environment: ``<cache_dir>/<env_id>/<graph_key>.json`` (the signed plan record, written with
:func:`~plancache.files.atomic_write`: a temporary file in the same folder, fsynced and renamed into place) and the
blobs in a :class:`~plancache.blobs.FolderBlobs`, ``<cache_dir>/<env_id>/blobs/ab/cd/<sha256>`` (owner-only files,
written the same way; every read hashed against the name, so a damaged or swapped file is never returned). Readers
see a whole file or none, and a crash loses no file that was written. Nothing read from here is trusted: the client
verifies every entry exactly like a network blob, and writes only plans whose signature it verified.

A folder of the earlier layout (each blob a file ``<cache_dir>/<env_id>/<sha256>.blob`` beside the records) is
moved into the blob folder when the cache is opened (:meth:`DiskCache.sweep`): each blob checked against its name
on the way (a damaged one is dropped) and keeping its time of last use, so an upgraded host without network still
starts from its cache. A folder that cannot be written keeps its old blob files, which are not read.

Revisions: ``<cache_dir>/<env_id>/<graph_key>.revision`` holds the highest revision of a signed record the
client accepted for that graph key and environment (:meth:`DiskCache.accept_revision`), so that no process
sharing the folder accepts an older record later, from the server or from disk (a replay): the client
refuses a lower one (reason ``revision``). These files are a few bytes each and are not evicted by the size
cap; they go with their environment's folder.

Revalidation: ``<cache_dir>/<env_id>/<graph_key>.checked`` is empty; its modification time is when the server last
gave or confirmed the entry (:meth:`DiskCache.checked_at`). An entry without one (written by ``bundle import``, or
before this file existed) counts as never confirmed. The client asks the server again about an entry confirmed
longer ago than ``PLANCACHE_REVALIDATE_SECONDS`` (:mod:`plancache.client.revalidate`).

One fetch per host: processes sharing the folder that miss the same graph keys at the same time ask the server
once. The first takes ``<cache_dir>/<env_id>/.fetch-<id>.lock`` (``id``: a digest of the sorted keys) with
``flock``, fetches and releases it once its disk writes are done; the others wait for the lock (at most the
client's ``request_deadline``, after which they ask the server themselves), read the entries it wrote (verified as
any disk entry is) and ask the server only for what is still missing (:meth:`DiskCache.fetch_lock`). The kernel
releases the lock of a process that dies holding it, so nobody waits for a dead one. Processes whose sets of keys
differ do not wait for each other.

Housekeeping, safe with other processes sharing the folder (each of them may evict or drop; a reader
that loses a file to another process just misses, and the plan comes from the next rung):

- **Size cap, least recently used first** (``max_bytes``, ``PLANCACHE_CACHE_MAX_BYTES``, 0: none): a hit
  sets the modification time of its record and blob to now, so file times order entries by last use.
  Each process counts what it writes; when its count passes the cap it scans the environment folders and
  deletes the least recently used files until the whole cache is at 90 % of the cap (the cap is exceeded
  between scans by at most what other processes wrote since their last scan).
- **Environments this host no longer has** (``max_age_days``, ``PLANCACHE_CACHE_MAX_AGE_DAYS``, 0: never):
  :meth:`DiskCache.sweep` (run when a :class:`~plancache.client.PlanCache` opens the cache) marks the
  current environment's folder used (the time of its ``.used`` file, also set by every write) and deletes
  every other environment folder (a name of 32 hex characters; nothing else under the root is touched)
  unused for that many days — e.g. the folder of the cuDNN or driver version before an upgrade.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..blobs.folder import FolderBlobs
from ..environment import ENV_ID_PATTERN, Environment
from ..errors import IntegrityError, Reason, VerificationError
from ..files import SAFE_OPEN_FLAGS, atomic_write, read_limited, unlock_and_close
from ..protocol import GRAPH_KEY_PATTERN, MAX_CANDIDATES_BYTES, MAX_RECORD_BYTES, PlanRecord
from ..signing import MAX_REVISION_LEAD_MS
from ..validation import from_answer, validation_message

log = logging.getLogger("plancache.client")

_GRAPH_KEY = re.compile(GRAPH_KEY_PATTERN)
_ENV_DIR = re.compile(ENV_ID_PATTERN)
#: A blob file of the earlier layout, beside the records (see the module docstring).
_OLD_BLOB = re.compile(r"^([0-9a-f]{64})\.blob$")
#: In an environment folder: the folder of its blob store.
BLOBS = "blobs"
#: Suffix of a record file.
RECORD_SUFFIX = ".json"
#: In an environment folder: its modification time is when a process last opened or wrote the folder.
USED_MARKER = ".used"
#: Name prefix of the lock files of fetches (:meth:`DiskCache.fetch_lock`).
FETCH_LOCK_PREFIX = ".fetch-"
#: Suffix of the file whose modification time is when the server last gave or confirmed an entry.
CHECKED_SUFFIX = ".checked"
#: A scan over the cap deletes down to this share of it, so the next scan is some writes away.
LOW_WATER = 0.9
#: A temporary file older than this is a crashed writer's, and is deleted by a scan (a fetch lock file unused
#: this long too).
STALE_TEMP_SECONDS = 3600.0
#: How often a process waiting for another's fetch tries the lock again.
LOCK_POLL_SECONDS = 0.005
#: In an environment folder: the lock (``flock``) under which a process reads, compares and writes a revision file.
REVISIONS_LOCK = ".revisions.lock"
#: The most a record file is read for: a record, or one an older client wrote with its tuning run's candidates in it
#: (loaded, the candidates dropped), pretty-printed or not.
RECORD_FILE_BYTES = 2 * (MAX_RECORD_BYTES + MAX_CANDIDATES_BYTES)


def _unlink(path: Path) -> int:
    """Delete ``path``; its size when this call deleted it, else 0 (another process was first)."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("plan cache: cannot remove %s: %s", path, exc)
        return 0
    return size


def _in_use(fd: int) -> None:
    """Touch a lock file just locked: in use, so not stale for the scan of old files."""
    with contextlib.suppress(OSError):
        os.utime(fd)


class FetchLock:
    """A held lock on fetching one set of graph keys into a cache folder (:meth:`DiskCache.fetch_lock`).
    ``waited``: another process held it first, and has now written what it fetched."""

    def __init__(self, fd: int, waited: bool) -> None:
        self._fd: int | None = fd
        self.waited = waited

    def release(self) -> None:
        """Let the next process waiting for these keys go; idempotent (:func:`~plancache.files.unlock_and_close`)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            unlock_and_close(fd)


class DiskCache:
    """Plan records and blobs (:attr:`blobs`) for one environment under ``root``; see the module docstring for the
    size cap (``max_bytes``, 0 or None: none) and the folders of other environments (``max_age_days``)."""

    def __init__(self, root: Path | str, environment: Environment, *, max_bytes: int | None = None,
                 max_age_days: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.dir = self.root / environment.env_id
        #: The blobs of this environment (created with the first write, never by a reader).
        self.blobs = _blob_store(self.dir)
        self.max_bytes = max_bytes or None
        self.max_age_days = max_age_days or None
        self._clock = clock
        self._estimate: int | None = None  # bytes under root as of this process's last scan, plus its writes
        self._revisions: dict[str, int] = {}  # accepted by this process, should the folder be read-only
        self._writer: ThreadPoolExecutor | None = None  # one thread: writes in the order they were asked for
        self._pending: list[tuple[Future[Any], str | None]] = []  # each write and the graph key it writes
        self._last_write: dict[str, Future[Any]] = {}  # per graph key, its last pending write
        self._pending_lock = threading.Lock()  # revalidation runs on its own thread
        self._closed = False  # closed: writes are made by their caller (a load of another thread still under way)

    def _record_path(self, graph_key: str) -> Path:
        if not _GRAPH_KEY.match(graph_key):
            raise ValueError(f"graph key {graph_key[:80]!r} is not 64 lowercase hex characters")
        return self.dir / f"{graph_key}{RECORD_SUFFIX}"

    def _stored_revision(self, path: Path) -> int:
        try:
            revision = int(read_limited(path, 64, planted=True))
        except (OSError, ValueError):  # none yet, unreadable or damaged
            return 0
        if revision > time.time_ns() // 1_000_000 + MAX_REVISION_LEAD_MS:
            # no signer's clock is that far ahead: a planted value (2**63 - 1 refused the plan for good), ignored
            log.warning("plan cache: ignored %s: revision %d is more than a day ahead of this clock", path, revision)
            return 0
        return revision

    def revision(self, graph_key: str) -> int:
        """The highest revision of a signed record accepted for ``graph_key`` on this environment, by this process
        or another one sharing the folder; 0 when none was."""
        path = self._record_path(graph_key).with_suffix(".revision")
        return max(self._stored_revision(path), self._revisions.get(graph_key, 0))

    def newest_revision(self, graph_key: str) -> int:
        """The highest revision this folder knows for ``graph_key``: accepted (:meth:`revision`) or of the record
        it holds; 0 for none."""
        try:
            record = self.record(graph_key)
        except VerificationError:
            record = None
        return max(self.revision(graph_key), record.revision if record else 0)

    def accept_revision(self, graph_key: str, revision: int, *, background: bool = True) -> None:
        """Remember that a signed record (or withdrawal) of ``revision`` was accepted for ``graph_key`` (a higher one
        remembered already stays): at once in this process, in the folder by the background writer (:meth:`later`)
        or, without ``background``, before returning. A folder that cannot be written keeps it for this process only."""
        self._revisions[graph_key] = max(revision, self._revisions.get(graph_key, 0))
        if background:
            self.later(self._write_revision, graph_key, revision, key=graph_key)
        else:
            self._write_revision(graph_key, revision)

    def checked_at(self, graph_key: str) -> float | None:
        """When the server last gave or confirmed the entry of ``graph_key`` (seconds since the epoch); None when
        it never did (see the module docstring)."""
        try:
            return self._record_path(graph_key).with_suffix(CHECKED_SUFFIX).stat().st_mtime
        except OSError:
            return None

    def mark_checked(self, graph_key: str) -> None:
        """Record that the server gave or confirmed the entry of ``graph_key`` now; a read-only folder stays as it is."""
        path = self._record_path(graph_key).with_suffix(CHECKED_SUFFIX)
        try:
            path.touch()
        except OSError as exc:
            log.debug("plan cache: cannot mark %s checked: %s", graph_key[:12], exc)

    def _write_revision(self, graph_key: str, revision: int) -> None:
        """Raise the stored revision of ``graph_key`` to ``revision``, never lower it: read, compared and written
        under the folder's revisions lock, so that a process writing a lower revision cannot rename its file over a
        higher one another process wrote meanwhile (a lowered floor would admit the older record again)."""
        path = self._record_path(graph_key).with_suffix(".revision")
        try:
            fd = self._open_lock(REVISIONS_LOCK)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                _in_use(fd)
                if self._stored_revision(path) < revision:
                    atomic_write(path, str(revision).encode())
            finally:
                unlock_and_close(fd)
        except OSError as exc:
            log.debug("plan cache: cannot write the revision of %s: %s", graph_key[:12], exc)

    def later(self, write: Callable[..., Any], *args: Any, key: str | None = None) -> None:
        """Run ``write(*args)`` on this cache's writer thread, off the caller's path: a plan is ready before its
        files are fsynced. ``key``: the graph key whose files it writes, so that a read of that key
        (:meth:`record`) waits for it, and a read of another key does not; :meth:`flush` (called by :meth:`close`)
        waits for every write; the interpreter also waits for them at exit. Once the interpreter is exiting (no new
        threads: a thread of the program still loading after the main thread returned) the write is made here."""
        with self._pending_lock:
            if not self._closed:
                if self._writer is None:
                    self._writer = ThreadPoolExecutor(1, thread_name_prefix="plancache-disk")
                self._forget_done()
                try:
                    future = self._writer.submit(write, *args)
                except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
                    pass
                else:
                    self._pending.append((future, key))
                    if key is not None:
                        self._last_write[key] = future
                    return
            pending = self._take(len(self._pending))
        for f, _ in pending:  # in the order they were asked for
            f.exception()
        try:
            write(*args)
        except Exception as exc:  # noqa: BLE001 - logged as a background write's failure is
            log.warning("plan cache: a write failed: %s", exc)

    def _forget_done(self) -> None:
        """Forget the writes done (holding ``_pending_lock``): the writer runs them in order, so they are the first
        ones (a scan of every pending write at each call was quadratic in the writes of a load: 2-3 ms of a 49-plan
        prefetch)."""
        done = 0
        while done < len(self._pending) and self._pending[done][0].done():
            done += 1
        self._take(done)

    def _take(self, count: int) -> list[tuple[Future[Any], str | None]]:
        """Remove the first ``count`` pending writes, and each key's last write among them (holding
        ``_pending_lock``); returns them."""
        taken = self._pending[:count]
        del self._pending[:count]
        for future, key in taken:
            if key is not None and self._last_write.get(key) is future:
                del self._last_write[key]
        return taken

    def flush(self, graph_key: str | None = None) -> None:
        """Wait for the writes asked for so far (a failed one was logged by itself); with ``graph_key``, for those up
        to that key's last one only (the writer runs them in order), none when it has none pending."""
        with self._pending_lock:
            if graph_key is not None:
                last = self._last_write.get(graph_key)
                if last is None:
                    return
                upto = next(i for i, (f, _) in enumerate(self._pending) if f is last) + 1
            else:
                upto = len(self._pending)
            pending = self._take(upto)
        for f, _ in pending:
            if (exc := f.exception()) is not None:
                log.warning("plan cache: a background write failed: %s", exc)

    def close(self) -> None:
        """Wait for the writes asked for and stop the writer thread; a write asked for later (by a load of another
        thread still under way) is made by its caller."""
        with self._pending_lock:
            self._closed = True
            writer, self._writer = self._writer, None
        self.flush()
        if writer is not None:
            writer.shutdown(wait=True)

    def record(self, graph_key: str) -> PlanRecord | None:
        """The stored record of ``graph_key``, unverified; None when there is none (or it cannot be read, logged).
        Its blob is in :attr:`blobs`. Raises :class:`VerificationError` (reason ``malformed``) for a record file
        that does not parse. Waits for the writes of ``graph_key`` this process asked for, not for others'."""
        self.flush(graph_key)
        try:
            text = read_limited(self._record_path(graph_key), RECORD_FILE_BYTES, planted=True)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise VerificationError(Reason.MALFORMED, f"cached record {graph_key[:12]} is larger than a record "
                                                          f"file can be ({exc.strerror})") from None
            log.warning("plan cache: cannot read the record of %s: %s", graph_key[:12], exc)
            return None
        try:
            return from_answer(PlanRecord, text)
        except ValidationError as exc:
            raise VerificationError(Reason.MALFORMED, f"cached record {graph_key[:12]} does not parse: "
                                                      f"{validation_message(exc.errors(), 1)}") from None

    def fetch_lock(self, graph_keys: Iterable[str], timeout: float) -> FetchLock | None:
        """The host's lock on fetching ``graph_keys`` from the server into this folder (see the module docstring),
        waiting at most ``timeout`` seconds for the process that holds it; None when it is still held then, or when
        the folder cannot hold a lock (unwritable, or a file system without ``flock``): ask the server anyway."""
        digest = hashlib.sha256("\n".join(sorted(graph_keys)).encode()).hexdigest()[:32]
        try:
            fd = self._open_lock(f"{FETCH_LOCK_PREFIX}{digest}.lock")
        except OSError as exc:
            log.debug("plan cache: no fetch lock in %s: %s", self.dir, exc)
            return None
        end, waited = time.monotonic() + timeout, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = True
                if time.monotonic() >= end:
                    log.info("plan cache: another process has been fetching these %s plans for over %g s; asking "
                             "the server too", digest[:12], timeout)
                    os.close(fd)
                    return None
                time.sleep(LOCK_POLL_SECONDS)
            except OSError as exc:
                log.debug("plan cache: cannot lock in %s: %s", self.dir, exc)
                os.close(fd)
                return None
        _in_use(fd)
        return FetchLock(fd, waited)

    def _open_lock(self, name: str) -> int:
        """An open descriptor of the lock file ``name`` in this folder, made (owner-only) with the folder if absent."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return os.open(self.dir / name, os.O_RDWR | os.O_CREAT | SAFE_OPEN_FLAGS, 0o600)

    def touch(self, record: PlanRecord) -> None:
        """Mark the entry of ``record`` (its record and blob files) used now, for the least recently used eviction;
        a read-only cache stays as it is."""
        for path in (self._record_path(record.graph_key), self.blobs.path(record.blob_sha256)):
            with contextlib.suppress(OSError):
                os.utime(path)

    def save(self, record: PlanRecord, blob: bytes, *, checked: bool = False) -> bool:
        """Store a plan (blob first, then the record that points at it), then keep the cache under its cap;
        ``checked``: it comes from the server now (:meth:`mark_checked`); otherwise the entry counts as never
        confirmed, whatever confirmed the one it replaces. Returns ``False``, after logging why,
        when the folder cannot be written: the cache is an optimisation. The caller stores only plans whose
        signature it verified."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            record_json = record.model_dump_json().encode()
            self.blobs.put(record.blob_sha256, blob)
            atomic_write(self._record_path(record.graph_key), record_json)
        except IntegrityError as exc:
            log.warning("plan cache: not writing the plan %s: %s", record.graph_key[:12], exc)
            return False
        except OSError as exc:
            log.warning("plan cache: cannot write %s: %s", self.dir, exc)
            return False
        if checked:
            self.mark_checked(record.graph_key)
        else:  # a record the server has not confirmed (a bundle's): the older entry's confirmation is not its
            with contextlib.suppress(OSError):
                self._record_path(record.graph_key).with_suffix(CHECKED_SUFFIX).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._mark_used()
        if self.max_bytes is not None:
            if self._estimate is None:
                self._estimate = self.size()
            else:
                self._estimate += len(blob) + len(record_json)
            if self._estimate > self.max_bytes:
                self.evict()
        return True

    def save_later(self, record: PlanRecord, blob: bytes) -> None:
        """:meth:`save` a plan the server (or its index) gave now, ``checked``, on the writer thread (:meth:`later`),
        a read of its graph key waiting for it."""
        self.later(partial(self.save, checked=True), record, blob, key=record.graph_key)

    def discard(self, graph_key: str, sha256: str | None = None) -> None:
        """Remove the record of ``graph_key`` (and its mark of when it was confirmed) and, when given, the blob
        ``sha256``."""
        _unlink(self._record_path(graph_key))
        _unlink(self._record_path(graph_key).with_suffix(CHECKED_SUFFIX))
        if sha256:
            _unlink(self.blobs.path(sha256))

    # ------------------------------------------------------------ housekeeping

    def _mark_used(self) -> None:
        marker = self.dir / USED_MARKER
        try:
            os.utime(marker)
        except FileNotFoundError:
            marker.touch()

    @staticmethod
    def _last_used(folder: Path) -> float:
        try:
            return (folder / USED_MARKER).stat().st_mtime
        except FileNotFoundError:
            return folder.stat().st_mtime

    def _env_dirs(self) -> list[Path]:
        try:
            return [p for p in self.root.iterdir() if _ENV_DIR.match(p.name) and p.is_dir() and not p.is_symlink()]
        except OSError:
            return []

    def _files(self) -> list[tuple[float, int, Path]]:
        """``(last use, size, path)`` of every record and blob file under root; crashed writers' temporary files and
        unused fetch locks are deleted."""
        now, files = self._clock(), []

        def stale(mtime: float) -> bool:
            return now - mtime > STALE_TEMP_SECONDS

        for folder in self._env_dirs():
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted meanwhile
                path = Path(entry.path)
                if entry.name.startswith(".") and entry.name.endswith((".tmp", ".lock")):
                    # The revisions lock is never deleted, however old: a process holding the file's flock and one
                    # that opened a new file of its name would both read, compare and write a revision at once.
                    if entry.name != REVISIONS_LOCK and stale(st.st_mtime):
                        _unlink(path)
                elif entry.name.endswith(RECORD_SUFFIX) and entry.is_file(follow_symlinks=False):
                    files.append((st.st_mtime, st.st_size, path))
            try:
                stored = list(_blob_store(folder).files())
            except OSError:
                continue
            for f in stored:
                if not f.temporary:
                    files.append((f.mtime, f.size, f.path))
                elif stale(f.mtime):
                    _unlink(f.path)
        return files

    def size(self) -> int:
        """Bytes of plan files under root (every environment)."""
        return sum(size for _, size, _ in self._files())

    def evict(self) -> int:
        """Delete the least recently used files until the cache is at :data:`LOW_WATER` of ``max_bytes``;
        returns the bytes this call deleted."""
        if self.max_bytes is None:
            return 0
        files = sorted(self._files(), key=lambda f: (f[0], f[2].suffix != RECORD_SUFFIX))  # a record before its blob
        total = sum(size for _, size, _ in files)
        target, freed = int(self.max_bytes * LOW_WATER), 0
        for _, size, path in files:
            if total - freed <= target:
                break
            freed += _unlink(path) or size  # deleted by another process meanwhile: gone all the same
        self._estimate = total - freed
        if freed:
            log.info("plan cache: evicted %d bytes of least recently used plans (cap %d bytes)", freed, self.max_bytes)
        return freed

    def sweep(self) -> list[Path]:
        """On opening the cache: mark this environment's folder used, and delete the folders of other
        environments unused for ``max_age_days``. Returns the folders deleted. Never raises: the cache is an
        optimisation, and a folder it cannot read or write is left as it is."""
        try:
            return self._sweep()
        except OSError as exc:
            log.warning("plan cache: cannot tidy %s: %s", self.root, exc)
            return []

    def _sweep(self) -> list[Path]:
        with contextlib.suppress(OSError):  # no folder for this environment yet, or a read-only cache
            self._mark_used()
            self._move_old_blobs()
        if self.max_age_days is None:
            return []
        oldest = self._clock() - self.max_age_days * 86400.0
        dropped = []
        for folder in self._env_dirs():
            if folder.name == self.dir.name:
                continue
            try:
                if self._last_used(folder) >= oldest:
                    continue
            except OSError:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                dropped.append(folder)
                log.info("plan cache: dropped %s, an environment unused for over %g days", folder, self.max_age_days)
        return dropped

    def _move_old_blobs(self) -> None:
        """Move the blob files of the earlier layout into :attr:`blobs` (see the module docstring)."""
        with os.scandir(self.dir) as entries:
            old = [(e, m[1]) for e in entries if (m := _OLD_BLOB.match(e.name)) and e.is_file(follow_symlinks=False)]
        for entry, sha256 in old:
            path = Path(entry.path)
            try:
                st = entry.stat(follow_symlinks=False)
                with path.open("rb") as fh:
                    self.blobs.put(sha256, fh)
                os.utime(self.blobs.path(sha256), ns=(st.st_atime_ns, st.st_mtime_ns))
            except FileNotFoundError:
                continue  # another process moved it meanwhile
            except IntegrityError as exc:
                log.warning("plan cache: dropped %s, a damaged blob: %s", path, exc)
            path.unlink(missing_ok=True)
        if old:
            log.info("plan cache: moved %d blobs of %s into %s", len(old), self.dir, self.blobs.root)


def _blob_store(folder: Path) -> FolderBlobs:
    """The blob store of an environment folder: owner-only files, its folder made by the first write."""
    return FolderBlobs(folder / BLOBS, mode=0o600, create=False)

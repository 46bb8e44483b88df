"""Finished job results on local disk, so a result survives the server being down or the worker restarting.

Each entry is ``job-<id>-<lease>.json`` (``<lease>`` a digest of the lease token): the signed record, the spec, the
bounded candidates table and the lease that completes the job, its secret token included (keep the spool directory
private to the worker). Its blob, the plan bytes, is in a :class:`~plancache.blobs.FolderBlobs` under the directory,
``blobs/ab/cd/<sha256>`` (owner-only files), checked against its name when written and when read. The blob is written
first and the JSON last, each atomically (temporary file, fsync, rename), so a JSON file always names a complete
blob. Once the server accepted (or definitively refused) an entry, its JSON goes, and its blob with it unless another
entry names the same bytes; a blob no entry names for :data:`ORPHAN_SECONDS` (a crash between the two writes) goes
with the next :meth:`Spool.pending`.

An entry of the earlier layout (its blob ``job-<id>-<lease>.blob`` beside the JSON) is moved into the blob folder
when read, checked on the way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..blobs import FolderBlobs
from ..errors import IntegrityError, VerificationError
from ..files import atomic_write, read_limited
from ..protocol import MAX_CANDIDATES_BYTES, MAX_RECORD_BYTES, Candidate, CandidateTable, PlanMeta, PlanUpload
from ..settings import DEFAULT_MAX_JSON_BYTES
from ..verify import verify_blob

log = logging.getLogger("plancache.worker")

#: 2: lease tokens are secret strings (version 1 entries held the counters servers no longer accept).
SPOOL_VERSION = 2
#: Seconds after which a blob no entry names is a crashed writer's (a live one writes its JSON right after the blob).
ORPHAN_SECONDS = 3600.0
#: The folder of the spool's blob store.
BLOBS = "blobs"
#: The most an entry's JSON file is read for: its record, spec (a maximal one is well within a request's JSON limit)
#: and candidates (in its record, in an entry of an earlier version), with room for its lease token, worker id and
#: escapes. A larger file is no entry this spool wrote: it is set aside unread.
ENTRY_FILE_BYTES = 2 * (MAX_RECORD_BYTES + DEFAULT_MAX_JSON_BYTES + MAX_CANDIDATES_BYTES)


@dataclass(frozen=True)
class SpoolEntry:
    """A finished, signed result waiting to be sent as the completion of ``job_id``."""

    job_id: int
    lease_token: str = field(repr=False)
    worker_id: str
    meta: PlanMeta
    spec: dict[str, Any]
    blob: bytes
    candidates: CandidateTable = field(default_factory=CandidateTable)

    @property
    def name(self) -> str:
        return f"job-{self.job_id}-{hashlib.sha256(self.lease_token.encode()).hexdigest()[:16]}"

    def upload(self) -> PlanUpload:
        """The upload of the signed record alone: the blob goes first, raw (``PUT /v1/blobs/{sha256}``)."""
        return PlanUpload(**self.meta.model_dump(), **self.candidates.model_dump(), spec=self.spec)


class Spool:
    """A directory of :class:`SpoolEntry` files (see the module docstring)."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.blobs = FolderBlobs(self.directory / BLOBS, mode=0o600)
        #: Entries delivered (or found unreadable) that could not be deleted: never read again by this object.
        self._undeletable: set[str] = set()

    def save(self, entry: SpoolEntry) -> Path:
        """Persist ``entry`` durably; return the path of its JSON file. :class:`~plancache.errors.IntegrityError`
        when its blob does not hash to its record's sha256 (nothing is spooled)."""
        self.blobs.put(entry.meta.blob_sha256, entry.blob)
        json_path = self.directory / f"{entry.name}.json"
        doc = {"version": SPOOL_VERSION, "job_id": entry.job_id, "lease_token": entry.lease_token,
               "worker_id": entry.worker_id, "meta": entry.meta.model_dump(mode="json"), "spec": entry.spec,
               "candidates": entry.candidates.model_dump(mode="json")}
        atomic_write(json_path, json.dumps(doc, sort_keys=True).encode())  # owner-only: it holds a lease token
        return json_path

    def pending(self) -> list[SpoolEntry]:
        """Entries waiting for upload, oldest first. An unreadable or inconsistent one is renamed
        ``*.corrupt`` (kept for inspection) with a log line, never uploaded: so is one whose JSON or blob is a
        symlink, a FIFO or anything but a regular file (none is followed or waited on), or larger than it can be
        (:data:`ENTRY_FILE_BYTES`, its record's ``blob_size``: not read)."""
        entries = []
        for path in self._entry_files(oldest_first=True):
            if path.stem in self._undeletable:
                continue
            try:
                entries.append(self._load(path))
            except FileNotFoundError:  # delivered and removed meanwhile by another worker sharing this folder
                continue
            except (OSError, ValueError, KeyError, TypeError, ValidationError, VerificationError,
                    IntegrityError) as exc:
                log.error("spool entry %s is unreadable (%s); renamed to %s.corrupt", path, exc, path.name)
                for p in (path, path.with_suffix(".blob")):  # the latter: an entry of the earlier layout
                    try:
                        os.replace(p, p.with_name(p.name + ".corrupt"))
                    except FileNotFoundError:
                        pass
                    except OSError as err:
                        log.error("could not rename %s (%s); it is skipped until this worker restarts", p, err)
                        self._undeletable.add(path.stem)
        self._drop_orphans()
        return entries

    def _entry_files(self, *, oldest_first: bool = False) -> list[Path]:
        """The entries' JSON files; with ``oldest_first``, by modification time (one removed meanwhile is left out)."""
        files = list(self.directory.glob("job-*.json"))
        if not oldest_first:
            return files
        dated = []
        for path in files:
            try:
                dated.append((path.stat().st_mtime, path))
            except FileNotFoundError:
                continue
        return [path for _, path in sorted(dated)]

    def _load(self, path: Path) -> SpoolEntry:
        doc = json.loads(read_limited(path, ENTRY_FILE_BYTES, planted=True))
        if doc.get("version") != SPOOL_VERSION:
            raise ValueError(f"unknown spool version {doc.get('version')!r}")
        legacy = doc["meta"].pop("candidates", None)  # an entry spooled when records carried them
        meta = PlanMeta.model_validate(doc["meta"])
        candidates = (CandidateTable.best_of([Candidate.model_validate(c) for c in legacy]) if legacy is not None
                      else CandidateTable.model_validate(doc.get("candidates", {})))
        entry = SpoolEntry(int(doc["job_id"]), str(doc["lease_token"]), str(doc["worker_id"]), meta, dict(doc["spec"]),
                           self._blob(meta, path), candidates)
        if entry.name != path.stem:
            raise ValueError(f"file name does not match job {entry.job_id} and its lease")
        return entry

    def _blob(self, meta: PlanMeta, path: Path) -> bytes:
        """The blob of the entry at ``path``, checked against its record (the store checks its digest as it reads
        it, :func:`~plancache.verify.verify_blob` its size and digest; one larger than that is not read); one of the
        earlier layout moved in first."""
        old = path.with_suffix(".blob")
        try:
            self.blobs.put(meta.blob_sha256, read_limited(old, meta.blob_size, planted=True))
            old.unlink()
        except FileNotFoundError:
            pass
        stream = self.blobs.open(meta.blob_sha256)
        if stream is not None and stream.size > meta.blob_size:  # one no larger is read, and checked as any
            stream.close()
            raise ValueError(f"its blob {meta.blob_sha256} is {stream.size} bytes, more than the {meta.blob_size} of "
                             f"its record (not read)")
        blob = None if stream is None else stream.whole()
        if blob is None:
            raise ValueError(f"its blob {meta.blob_sha256} is missing or damaged")
        verify_blob(meta, blob, what=path.name)
        return blob

    def _named(self) -> set[str]:
        """The blobs the entries' records name (an unreadable entry names none)."""
        named = set()
        for path in self._entry_files():
            try:
                named.add(str(json.loads(read_limited(path, ENTRY_FILE_BYTES, planted=True))["meta"]["blob_sha256"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return named

    def _drop_orphans(self) -> None:
        """Delete the blobs and temporary files no entry names that are older than :data:`ORPHAN_SECONDS`."""
        named, cutoff = self._named(), time.time() - ORPHAN_SECONDS
        for f in self.blobs.files():
            if f.mtime < cutoff and (f.temporary or f.sha256 not in named):
                try:
                    f.path.unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("could not delete the orphaned spool file %s (%s)", f.path, exc)

    def remove(self, entry: SpoolEntry) -> None:
        """Delete ``entry``, and its blob unless another entry names the same bytes. One that cannot be deleted (a
        read-only folder) is logged and skipped by :meth:`pending` from then on, so it is not delivered again."""
        try:
            (self.directory / f"{entry.name}.json").unlink(missing_ok=True)
            if entry.meta.blob_sha256 not in self._named():
                self.blobs.delete(entry.meta.blob_sha256)
        except OSError as exc:
            log.error("could not delete the delivered spool entry %s (%s); delete it by hand", entry.name, exc)
            self._undeletable.add(entry.name)

"""Finished job results on local disk, so a result survives the server being down or the worker restarting.

Each entry is ``job-<id>-<lease>.blob`` (the plan bytes; ``<lease>`` a digest of the lease token) plus
``.json`` (the signed record, the spec, the bounded candidates table and the lease that completes the job, its secret
token included: keep the spool directory private to the worker). The blob is written first and the
JSON last, each atomically (temporary file, fsync, rename), so a JSON file always names a
complete blob. An entry is removed once the server accepted (or definitively refused) it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import VerificationError
from ..files import atomic_write
from ..protocol import Candidate, CandidateTable, PlanMeta, PlanUpload
from ..verify import verify_blob

log = logging.getLogger("plancache.worker")

#: 2: lease tokens are secret strings (version 1 entries held the counters servers no longer accept).
SPOOL_VERSION = 2


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
    """A directory of :class:`SpoolEntry` files."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def save(self, entry: SpoolEntry) -> Path:
        """Persist ``entry`` durably; return the path of its JSON file."""
        blob_path = self.directory / f"{entry.name}.blob"
        json_path = self.directory / f"{entry.name}.json"
        atomic_write(blob_path, entry.blob)  # both files owner-only (atomic_write's 0600): the JSON holds a lease token
        doc = {"version": SPOOL_VERSION, "job_id": entry.job_id, "lease_token": entry.lease_token,
               "worker_id": entry.worker_id, "meta": entry.meta.model_dump(mode="json"), "spec": entry.spec,
               "candidates": entry.candidates.model_dump(mode="json")}
        atomic_write(json_path, json.dumps(doc, sort_keys=True).encode())
        return json_path

    def pending(self) -> list[SpoolEntry]:
        """Entries waiting for upload, oldest first. An unreadable or inconsistent one is renamed
        ``*.corrupt`` (kept for inspection) with a log line, never uploaded."""
        entries = []
        for path in sorted(self.directory.glob("job-*.json"), key=lambda p: p.stat().st_mtime):
            try:
                entries.append(self._load(path))
            except (OSError, ValueError, KeyError, TypeError, ValidationError, VerificationError) as exc:
                log.error("spool entry %s is unreadable (%s); renamed to %s.corrupt", path, exc, path.name)
                for p in (path, path.with_suffix(".blob")):
                    if p.exists():
                        os.replace(p, p.with_name(p.name + ".corrupt"))
        return entries

    def _load(self, path: Path) -> SpoolEntry:
        doc = json.loads(path.read_text())
        if doc.get("version") != SPOOL_VERSION:
            raise ValueError(f"unknown spool version {doc.get('version')!r}")
        legacy = doc["meta"].pop("candidates", None)  # an entry spooled when records carried them
        meta = PlanMeta.model_validate(doc["meta"])
        candidates = (CandidateTable.best_of([Candidate.model_validate(c) for c in legacy]) if legacy is not None
                      else CandidateTable.model_validate(doc.get("candidates", {})))
        blob = path.with_suffix(".blob").read_bytes()
        verify_blob(meta, blob, what=path.with_suffix(".blob").name)
        entry = SpoolEntry(int(doc["job_id"]), str(doc["lease_token"]), str(doc["worker_id"]), meta, dict(doc["spec"]), blob,
                           candidates)
        if entry.name != path.stem:
            raise ValueError(f"file name does not match job {entry.job_id} and its lease")
        return entry

    def remove(self, entry: SpoolEntry) -> None:
        for suffix in (".json", ".blob"):
            (self.directory / f"{entry.name}{suffix}").unlink(missing_ok=True)

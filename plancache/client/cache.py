"""The client's local disk cache of verified plans, so a process with no network starts from it.

Layout: ``<cache_dir>/<env_id>/<graph_key>.json`` (the plan record) and
``<cache_dir>/<env_id>/<sha256>.blob`` (the blob). Every file is written to a temporary file in
the same folder and moved into place with ``os.replace``, so readers see a whole file or none;
no fsync: a file damaged by a crash fails verification on its next read and is dropped.
Nothing read from here is trusted: the client verifies every entry exactly like a network blob.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

from pydantic import ValidationError

from ..environment import Environment
from ..errors import VerificationError
from ..protocol import PlanRecord

log = logging.getLogger("plancache.client")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class DiskCache:
    """Plan records and blobs for one environment under ``root``."""

    def __init__(self, root: Path | str, environment: Environment) -> None:
        self.dir = Path(root) / environment.env_id

    def _record_path(self, graph_key: str) -> Path:
        if not _HEX64.match(graph_key):
            raise ValueError(f"graph key {graph_key[:80]!r} is not 64 lowercase hex characters")
        return self.dir / f"{graph_key}.json"

    def _blob_path(self, sha256: str) -> Path:
        return self.dir / f"{sha256}.blob"  # PlanRecord validated the pattern: no path tricks

    def load(self, graph_key: str) -> tuple[PlanRecord, bytes] | None:
        """The stored record and blob for ``graph_key``, unverified; ``None`` when there is no whole entry.

        Raises :class:`VerificationError` (reason ``malformed``) for a record file that does not parse."""
        try:
            text = self._record_path(graph_key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("plan cache: cannot read the record of %s: %s", graph_key[:12], exc)
            return None
        try:
            record = PlanRecord.model_validate_json(text)
        except ValidationError as exc:
            raise VerificationError("malformed", f"cached record {graph_key[:12]} does not parse: "
                                                 f"{exc.errors()[0].get('msg', exc)}") from None
        try:
            blob = self._blob_path(record.blob_sha256).read_bytes()
        except OSError as exc:
            log.warning("plan cache: cannot read the blob of %s (%s); ignoring the entry", graph_key[:12], exc)
            return None
        return record, blob

    def save(self, record: PlanRecord, blob: bytes) -> bool:
        """Store a verified plan (blob first, then the record that points at it). Returns ``False``,
        after logging why, when the folder cannot be written: the cache is an optimisation."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            _write_atomic(self._blob_path(record.blob_sha256), blob)
            _write_atomic(self._record_path(record.graph_key), record.model_dump_json().encode())
        except OSError as exc:
            log.warning("plan cache: cannot write %s: %s", self.dir, exc)
            return False
        return True

    def discard(self, graph_key: str, sha256: str | None = None) -> None:
        """Remove the record of ``graph_key`` and, when given, the blob ``sha256``."""
        paths = [self._record_path(graph_key)] + ([self._blob_path(sha256)] if sha256 else [])
        for path in paths:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("plan cache: cannot remove %s: %s", path, exc)

"""Blobs in a local folder (or a volume every replica mounts): one file per blob, ``root/ab/cd/<sha256>``."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from ..files import fsync_dir
from .base import BlobStore, BlobStream, Data, checked, chunks, log, shard

#: Opening a blob file: never through a symlink, never blocking on a FIFO planted under its name.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class FolderBlobs(BlobStore):
    """Bytes in files ``root/ab/cd/<sha256>``, written atomically and durably (a temporary file ``.<sha256>.*.tmp``
    beside it, fsynced, renamed over it, the folder fsynced) after the bytes hashed to their name.

    Every read hashes the file as it goes (the cost: docs/DEPLOYMENT.md, "Blob store"), so a file replaced by a
    symlink, truncated or overwritten is never returned: :meth:`get` treats it as missing and logs it, a stream
    from :meth:`open` fails before its last chunk. :meth:`put` replaces such a file, even one of the right size."""

    def __init__(self, root: Path, *, mode: int = 0o644) -> None:
        """``mode``: the files' permissions (default readable by every replica sharing the folder)."""
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.url, self.mode = root, root.as_uri(), mode

    def path(self, sha256: str) -> Path:
        return self.root / shard(sha256)

    def size(self, sha256: str) -> int | None:
        try:
            st = os.lstat(self.path(sha256))
        except FileNotFoundError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def open(self, sha256: str) -> BlobStream | None:
        path = self.path(sha256)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            log.warning("%s: blob %s is a symlink, treated as missing", self.url, sha256)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                log.warning("%s: blob %s is not a regular file, treated as missing", self.url, sha256)
                os.close(fd)
                return None
            fh = os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        return BlobStream(sha256, st.st_size, chunks(fh), fh.close, source=self.url)

    def _intact(self, sha256: str) -> bool:
        return self.get(sha256) is not None

    def put(self, sha256: str, data: Data) -> None:
        path = self.path(sha256)
        if self._intact(sha256):
            for _ in checked(sha256, chunks(data)):  # the caller's bytes are checked all the same
                pass
            return
        for folder in (path.parent.parent, path.parent):
            if not folder.is_dir():
                folder.mkdir(exist_ok=True)
                fsync_dir(folder.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), self.mode)
                for piece in checked(sha256, chunks(data)):
                    fh.write(piece)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)  # replaces a symlink or a damaged file, never writes through it
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)

"""Blobs in a local folder (or a volume every replica mounts): one file per blob, ``root/ab/cd/<sha256>``."""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from ..files import SAFE_OPEN_FLAGS, fsync_dir
from .base import BlobStore, BlobStream, Data, checked_chunks, chunks, log, shard

#: A shard folder's name (``ab`` of ``ab/cd/<sha256>``), a blob file's, and a temporary file's: ``.<sha256>.*.tmp``,
#: as :meth:`FolderBlobs.put` (and :func:`plancache.files.atomic_write`) name the file they write.
_SHARD = re.compile(r"^[0-9a-f]{2}$")
_BLOB_FILE = re.compile(r"^[0-9a-f]{64}$")
_TEMPORARY = re.compile(r"^\.([0-9a-f]{64})\..+\.tmp$")


class StoredFile(NamedTuple):
    """A file of a blob folder: a blob's bytes, or a writer's temporary file; ``mtime`` its last modification."""

    path: Path
    sha256: str
    size: int
    temporary: bool
    mtime: float


class FolderBlobs(BlobStore):
    """Bytes in files ``root/ab/cd/<sha256>``, written atomically and durably (a temporary file ``.<sha256>.*.tmp``
    beside it, fsynced, renamed over it, the folder fsynced) after the bytes hashed to their name.

    Every read hashes the file as it goes (the cost: docs/DEPLOYMENT.md, "Blob store"), so a file replaced by a
    symlink, truncated or overwritten is never returned: :meth:`get` treats it as missing and logs it, a stream
    from :meth:`open` fails before its last chunk. :meth:`put` replaces such a file, even one of the right size."""

    def __init__(self, root: Path, *, mode: int = 0o644, create: bool = True) -> None:
        """``mode``: the files' permissions (default readable by every replica sharing the folder). ``create``: make
        ``root`` now; else the first :meth:`put` makes it (a reader of a folder never written creates nothing). A
        relative ``root`` is taken from the current directory now."""
        root = root.absolute()
        if create:
            root.mkdir(parents=True, exist_ok=True)
        self.root, self.url, self.mode = root, root.as_uri(), mode

    def path(self, sha256: str) -> Path:
        return self.root / shard(sha256)

    def size(self, sha256: str) -> int | None:
        try:
            st = os.lstat(self.path(sha256))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def open(self, sha256: str) -> BlobStream | None:
        path = self.path(sha256)
        try:
            fd = os.open(path, os.O_RDONLY | SAFE_OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):  # no such file, or a file where its shard folder goes
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
            for _ in checked_chunks(sha256, data):  # the caller's bytes are checked all the same
                pass
            return
        for folder in (self.root, path.parent.parent, path.parent):
            if folder.is_dir():
                continue
            try:  # another process may make the same folder meanwhile: that is no obstacle
                folder.mkdir(parents=True, exist_ok=True)
            except FileExistsError:  # a file or a dangling link in the way: no blob of this shard can be written
                raise OSError(errno.ENOTDIR, f"{folder} is in the way of a blob shard folder (not a folder)",
                              str(folder)) from None
            fsync_dir(folder.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), self.mode)
                for piece in checked_chunks(sha256, data):
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

    def files(self) -> Iterator[StoredFile]:
        """The blob files and writers' temporary files in ``root/ab/cd/``, as found (none when ``root`` is absent).
        Nothing else is listed: another name, a file in the wrong shard, a symlink, a folder; nor a file renamed
        into place or deleted between its folder's listing and its ``stat``."""
        for first in _folders(self.root):
            for second in _folders(first):
                try:
                    with os.scandir(second) as entries:
                        found = list(entries)
                except FileNotFoundError:
                    continue
                for entry in found:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    path = Path(entry.path)
                    if _BLOB_FILE.match(entry.name) and entry.name[:4] == first.name + second.name:
                        yield StoredFile(path, entry.name, st.st_size, False, st.st_mtime)
                    elif (m := _TEMPORARY.match(entry.name)) is not None:
                        yield StoredFile(path, m[1], st.st_size, True, st.st_mtime)

    def files_older_than(self, cutoff: float) -> Iterator[StoredFile]:
        """The :meth:`files` last modified before ``cutoff`` (seconds since the epoch)."""
        return (f for f in self.files() if f.mtime < cutoff)


def _folders(parent: Path) -> list[Path]:
    """The shard folders (two hex digits, not symlinks) in ``parent``; none when it is absent."""
    try:
        with os.scandir(parent) as entries:
            return [Path(e.path) for e in entries if _SHARD.match(e.name) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []

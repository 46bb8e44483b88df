"""Durable, atomic file writes: a reader sees the old file or the whole new one, and a crash loses neither; the
flags for opening a file someone else could have planted; reads of a user's file bounded in size; the release of a
file lock that survives a fork."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path

#: Opening a file whose name someone else could have planted: never through a symlink (ELOOP), never blocking on a FIFO.
SAFE_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def fsync_dir(path: Path | str) -> None:
    """Flush folder ``path``'s entries (a rename or a new name in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path | str, data: bytes, *, mode: int = 0o600, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` atomically and durably: a temporary file ``.NAME.*.tmp`` in the same folder with
    permissions ``mode``, fsynced, renamed over ``path``, then the folder fsynced. With ``exclusive`` the file is
    linked into place instead and ``FileExistsError`` raised when ``path`` exists (nothing is replaced)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if exclusive:
            os.link(tmp, path)
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_limited(path: str | os.PathLike[str], limit: int, *, planted: bool = False) -> bytes:
    """The bytes of the file ``path``, at most ``limit``: past it ``OSError`` (``EFBIG``) whose ``strerror`` gives the
    size (a regular file's before a byte is read) and the limit. At most ``limit + 1`` bytes are read, so a device or
    pipe that never ends (``/dev/zero``) costs no more; a FIFO is opened without waiting for a writer (none: empty).
    With ``planted`` (a file whose name someone else could have planted) a symlink is not followed (``ELOOP``) and
    anything but a regular file is refused (``EINVAL``) before a byte is read."""
    fd = os.open(path, os.O_RDONLY | (SAFE_OPEN_FLAGS if planted else os.O_NONBLOCK | os.O_CLOEXEC))
    try:
        info = os.fstat(fd)
        if planted and not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        if stat.S_ISREG(info.st_mode) and info.st_size > limit:
            raise too_large(path, info.st_size, limit)
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise too_large(path, None, limit)
    return b"".join(chunks)


def too_large(path: str | os.PathLike[str], size: int | None, limit: int) -> OSError:
    """The ``OSError`` (``EFBIG``) of a file of ``size`` bytes (None: not known, more than ``limit``) over ``limit``."""
    said = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return OSError(errno.EFBIG, f"{said}, over the limit of {limit} bytes", os.fspath(path))


def unlock_and_close(fd: int) -> None:
    """Release the ``flock`` held on ``fd``, then close it. Unlocked first: a process forked meanwhile (a data
    loader's workers) shares the open file, and closing ours alone would leave it locked for as long as they live."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)

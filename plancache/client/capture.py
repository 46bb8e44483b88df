"""Capture files: every graph a program built, as specs to tune before a fleet needs them.

A capture file (``plancache capture``, or ``PLANCACHE_CAPTURE=FILE`` with the hook installed) is JSON::

    {"format": "plancache-capture", "version": 1,
     "graphs": [{"graph_key": "…", "name": "sdpa_fwd", "count": 12, "spec": {…schema-2 document…}}, …]}

``count`` is how many graphs of that key the program built. Several processes (a launcher's ranks, a test suite)
may capture into one file: each adds its counts under a lock (``FILE.lock``). Nothing is uploaded.

A captured graph's variants along its shape axes are :func:`plancache.spec.axes.vary`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from ..errors import SpecError
from ..files import atomic_write, read_limited, unlock_and_close
from ..spec import GraphSpec, parse_spec
from ..validation import StrictModel, validation_message

CAPTURE_FORMAT = "plancache-capture"
#: Most graphs one capture file holds.
MAX_CAPTURED = 100_000
#: The largest capture file read: :data:`MAX_CAPTURED` graphs of about 5 KB (a captured attention or matmul graph is
#: 2-4 KB), so that ``/dev/zero`` or a large file given by mistake is refused, not read until memory runs out.
MAX_CAPTURE_BYTES = 512 * 1024 * 1024
#: How a capture file starts (:class:`Recorder` writes its format first): one cut off is still told from a spec.
_CAPTURE_START = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + re.escape(CAPTURE_FORMAT.encode()) + rb'"')



class CapturedGraph(StrictModel):
    graph_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str = Field(default="", max_length=256)
    count: int = Field(ge=1)
    spec: dict[str, Any]


class CaptureFile(StrictModel):
    format: Literal["plancache-capture"]
    version: Literal[1]
    graphs: list[CapturedGraph] = Field(max_length=MAX_CAPTURED)


def is_capture(doc: Any) -> bool:
    """Whether a parsed JSON document is a capture file (else: a spec)."""
    return isinstance(doc, dict) and doc.get("format") == CAPTURE_FORMAT


def starts_as_capture(data: bytes) -> bool:
    """Whether a file's bytes start as a capture file's do, valid JSON or not (one cut off)."""
    return _CAPTURE_START.match(data) is not None


def _capture_file(doc: Any) -> CaptureFile:
    """``doc`` as a capture file, its specs not parsed; :class:`SpecError` names what is wrong."""
    try:
        return CaptureFile.model_validate(doc)
    except ValidationError as exc:
        raise SpecError(f"not a valid capture file: {validation_message(exc.errors())}") from None


def parse_capture(doc: Any) -> list[tuple[GraphSpec, int]]:
    """The specs of a capture file and how often each was built; :class:`SpecError` names what is wrong (a spec
    whose key is not the one written next to it, too)."""
    graphs = []
    for i, g in enumerate(_capture_file(doc).graphs):
        try:
            spec = parse_spec(g.spec)
        except SpecError as exc:
            raise SpecError(f"graphs[{i}]: {exc.message}") from None
        if spec.graph_key != g.graph_key:
            raise SpecError(f"graphs[{i}]: its spec's graph key is {spec.graph_key}, not {g.graph_key} "
                            "(the file was edited, or written by another plancache version)")
        graphs.append((spec, g.count))
    return graphs


def _load_json(path: str | os.PathLike[str]) -> Any:
    """The JSON document in the file ``path`` (at most :data:`MAX_CAPTURE_BYTES`); :class:`SpecError` naming the file
    when it cannot be read or parsed."""
    try:
        data = read_limited(path, MAX_CAPTURE_BYTES)
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the capture file ({exc.strerror or exc})") from None
    return load_json(path, data)


def load_json(path: str | os.PathLike[str], data: bytes) -> Any:
    """The JSON document of ``data``, the bytes of the file ``path``; :class:`SpecError` naming the file when it is
    not JSON (one that starts as a capture file: cut off or damaged)."""
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise SpecError(f"{path}: not a capture file (nested too deeply)") from None
    except ValueError as exc:  # UnicodeDecodeError too
        if starts_as_capture(data):
            raise SpecError(f"{path}: the capture file is cut off or damaged (not valid JSON: {str(exc)[:200]}); copy "
                            "it again, or capture again (plancache capture)") from None
        raise SpecError(f"{path}: not a capture file (not JSON: {exc})") from None


def read_capture(path: str | os.PathLike[str]) -> list[tuple[GraphSpec, int]]:
    """:func:`parse_capture` of a file; :class:`SpecError` naming the file when it cannot be read or is not a valid
    capture file."""
    doc = _load_json(path)
    if not is_capture(doc):
        raise SpecError(f"{path}: not a capture file (write one with plancache capture or PLANCACHE_CAPTURE)")
    try:
        return parse_capture(doc)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc.message}") from None


class Recorder:
    """Counts the graphs a process builds and merges them into a capture file: at the first build of each key (so
    a process that dies keeps what it met) and on :meth:`flush` (the hook flushes at exit)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._specs: dict[str, GraphSpec] = {}
        self._pending: Counter[str] = Counter()

    def _own(self) -> None:
        """In a process forked from the one that made this recorder, start afresh: the counts pending in the parent
        are the parent's to write (a child that wrote them too counted them twice), its lock may be held by a thread
        the child does not have, and the child's first build of each key is written at once."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._specs = {}
            self._pending = Counter()

    def add(self, spec: GraphSpec) -> None:
        self._own()
        with self._lock:
            new = spec.graph_key not in self._specs
            self._specs.setdefault(spec.graph_key, spec)
            self._pending[spec.graph_key] += 1
            if new:
                self._flush()

    def flush(self) -> None:
        self._own()
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        with _file_lock(self.path):
            graphs: dict[str, dict[str, Any]] = {}
            if self.path.exists():
                doc = _load_json(self.path)
                # The entries are carried over as they are, their specs not parsed nor hashed again (that made the
                # first build of each new graph wait 5.7 s under the lock with 10,000 graphs in the file); whoever
                # reads the file checks each spec against its key. A key listed twice (files merged by hand) keeps
                # both counts.
                for g in _capture_file(doc).graphs:
                    entry = graphs.setdefault(g.graph_key, {"graph_key": g.graph_key, "name": g.name, "count": 0,
                                                            "spec": g.spec})
                    entry["count"] += g.count
            for key, n in self._pending.items():
                entry = graphs.setdefault(key, _entry(self._specs[key], 0))
                entry["count"] += n
            # the most built first; past MAX_CAPTURED, the least built are left out (a reader takes no more)
            ordered = sorted(graphs.values(), key=lambda g: (-g["count"], g["graph_key"]))[:MAX_CAPTURED]
            # one graph a line, each by json's C encoder (indent= takes its pure-Python one: 1.2 s for 2,000 graphs)
            lines = ",\n".join(json.dumps(g, separators=(",", ":")) for g in ordered)
            data = f'{{"format": "{CAPTURE_FORMAT}", "version": 1, "graphs": [\n{lines}\n]}}\n'.encode()
            if len(data) > MAX_CAPTURE_BYTES:  # no reader would take it: the file stays as it was
                raise SpecError(f"{self.path}: the capture file would be {len(data)} bytes, over the limit of "
                                f"{MAX_CAPTURE_BYTES} bytes a reader takes; capture into another file")
            atomic_write(self.path, data, mode=0o644)
        self._pending.clear()


def _entry(spec: GraphSpec, count: int) -> dict[str, Any]:
    return {"graph_key": spec.graph_key, "name": spec.name, "count": count, "spec": spec.to_json()}


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        unlock_and_close(fd)

"""Test doubles of the client's GPU backend (no GPU): they record every call, so tests can assert that a
rejected blob never reached ``deserialize``; and of hostile servers (:class:`DripServer`, :class:`CountedStream`)."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from plancache.environment import Environment
from plancache.spec import GraphSpec

from .factories import H200


@dataclass
class FakeBuiltPlan:
    """Stands for :class:`plancache.gpu.BuiltPlan`; records its executions."""

    spec: GraphSpec
    how: str
    workspace_size: int = 4096
    engine_id: int | None = None
    knobs: dict[str, int] = field(default_factory=dict)
    plan_name: str = ""
    kernel_cache: Any = None
    graph: Any = None
    executions: list[tuple[dict[int, Any], Any, Any]] = field(default_factory=list)
    #: What :meth:`layouts` answers (the loaded graph's layouts); None: the dims and strides the spec holds.
    real_layouts: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None

    def execute(self, tensors: dict[int, Any], workspace: Any, handle: Any) -> None:
        self.executions.append((tensors, workspace, handle))

    def layouts(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        if self.real_layouts is not None:
            return dict(self.real_layouts)
        doc = self.spec.canonical_document()
        return {t.uid: (tuple(t.dim), tuple(t.stride)) for t in doc.input_tensors() + doc.output_tensors()
                if t.dim and t.stride}


class FakeKernelCache:
    def __init__(self, n: int) -> None:
        self.n = n


class FakeStream:
    """A stream stand-in with a ``cuda_stream`` id (no ``device``: the plan does not check it)."""

    def __init__(self, sid: int) -> None:
        self.cuda_stream = sid


def _cpu() -> Any:
    """torch's CPU device, or the name of it on an install without torch (the ladder never touches it)."""
    try:
        import torch
    except ModuleNotFoundError:
        return "cpu"
    return torch.device("cpu")


class RecordingBackend:
    """A :class:`plancache.client.backend.Backend` double on the CPU that records every call.

    ``deserialized`` holds each blob given to ``deserialize``; ``calls`` each operation as
    ``(op, graph_key)``. ``fail`` names operations that raise (``deserialize``, ``engine_config``,
    ``dynamic`` — heuristic builds with a kernel cache — or ``heuristic``)."""

    def __init__(self, env: Environment = H200, *, fail: tuple[str, ...] = ()) -> None:
        self.device = _cpu()
        self.handle = object()
        self._env = env
        self.fail = set(fail)
        self.deserialized: list[bytes] = []
        self.calls: list[tuple[str, str]] = []
        self.kernel_caches: list[FakeKernelCache] = []
        self.streams_set: list[Any] = []
        self.workspaces: list[tuple[int, Any]] = []
        self.made_for: list[RecordingBackend] = []
        self.stream = FakeStream(7)
        self._current: Any = None
        self.on_device_now = False
        self.handles_made: list[Any] = []

    def environment(self) -> Environment:
        return self._env

    def for_device(self, device: int) -> RecordingBackend:
        """A recording backend on ``cuda:<device>`` (a torch device, no GPU needed), of the same environment;
        ``made_for`` records each."""
        import torch

        other = type(self)(self._env, fail=tuple(self.fail))
        other.device = torch.device("cuda", device)
        self.made_for.append(other)
        return other

    def deserialize(self, spec: GraphSpec, blob: bytes, *, engine_id: int | None, knobs: dict[str, int],
                    plan_name: str, graph: Any = None) -> FakeBuiltPlan:
        self.deserialized.append(bytes(blob))
        self.calls.append(("deserialize", spec.graph_key))
        if "deserialize" in self.fail:
            raise RuntimeError("cudnn refused the blob")
        return FakeBuiltPlan(spec, f"deserialized:{hashlib.sha256(blob).hexdigest()[:8]}", engine_id=engine_id,
                             knobs=dict(knobs), plan_name=plan_name, graph=graph)

    def build_engine_config(self, spec: GraphSpec, engine_id: int, knobs: dict[str, int], *,
                            graph: Any = None) -> FakeBuiltPlan:
        self.calls.append(("engine_config", spec.graph_key))
        if "engine_config" in self.fail:
            raise RuntimeError(f"engine {engine_id} is not supported")
        return FakeBuiltPlan(spec, "engine_config", engine_id=engine_id, knobs=dict(knobs), graph=graph)

    def build_heuristic(self, spec: GraphSpec, kernel_cache: Any, *, graph: Any = None) -> FakeBuiltPlan:
        self.calls.append(("heuristic" if kernel_cache is None else "heuristic_dynamic", spec.graph_key))
        if kernel_cache is not None and "dynamic" in self.fail:
            raise RuntimeError("dynamic shapes are not supported for this graph")
        if "heuristic" in self.fail:
            raise RuntimeError("no engine supports this graph")
        return FakeBuiltPlan(spec, "heuristic", engine_id=0, kernel_cache=kernel_cache, graph=graph)

    def prepare_graph(self, graph: Any, spec: GraphSpec) -> None:
        from plancache.gpu.fegraph import canonicalize_uids

        self.calls.append(("prepare_graph", spec.graph_key))
        canonicalize_uids(graph, spec)

    def create_kernel_cache(self) -> FakeKernelCache:
        cache = FakeKernelCache(len(self.kernel_caches))
        self.kernel_caches.append(cache)
        return cache

    def current_stream(self) -> Any:
        return self.stream

    def new_workspace(self, nbytes: int, stream: Any) -> Any:
        """A CPU tensor; ``workspaces`` records ``(nbytes, stream)`` of each."""
        import torch

        self.workspaces.append((nbytes, stream))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)

    def set_stream(self, stream: Any) -> None:
        if stream is not self._current:
            self.streams_set.append(stream)
            self._current = stream

    def new_handle(self) -> Any:
        """A stand-in handle; ``handles_made`` records each."""
        handle = object()
        self.handles_made.append(handle)
        return handle

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """``on_device`` is True inside the block (the plan's launches must happen there)."""
        self.on_device_now = True
        try:
            yield
        finally:
            self.on_device_now = False


def read_request(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """One HTTP request from a raw socket: its head (request line and headers) and its body (``Content-Length``
    bytes); None when the peer hung up before the head ended."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head, body


class DripServer:
    """A raw HTTP/1.1 server on 127.0.0.1 that answers every request with ``body`` (JSON), one byte every
    ``interval`` seconds — the body only, or the status line and headers too (``drip_headers``). ``sent``
    counts the body bytes sent; ``requests`` the requests read. Use as a context manager."""

    def __init__(self, body: bytes, *, interval: float, drip_headers: bool = False) -> None:
        self.body, self.interval, self.drip_headers = body, interval, drip_headers
        self.sent = 0
        self.requests = 0
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _drip(self, conn: socket.socket, data: bytes, counted: bool) -> bool:
        for i in range(len(data)):
            if self._stop.is_set():
                return False
            conn.sendall(data[i:i + 1])
            if counted:
                self.sent += 1
            self._stop.wait(self.interval)
        return True

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                if read_request(conn) is None:
                    return
                self.requests += 1
                status = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(self.body)}\r\n\r\n").encode()
                if self.drip_headers:
                    if not self._drip(conn, status, counted=False):
                        return
                else:
                    conn.sendall(status)
                self._drip(conn, self.body, counted=True)
            except OSError:  # the client hung up
                return

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> DripServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CountedStream(httpx.SyncByteStream):
    """A response body of ``size`` bytes made lazily in ``chunk``-byte pieces; ``read`` counts the bytes the
    client pulled (what a hostile server would have pushed into its memory)."""

    def __init__(self, size: int, chunk: int = 64 * 1024) -> None:
        self.size, self.chunk = size, chunk
        self.read = 0

    def __iter__(self) -> Iterator[bytes]:
        while self.read < self.size:
            n = min(self.chunk, self.size - self.read)
            self.read += n
            yield b"\0" * n

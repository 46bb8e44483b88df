"""How the app is served: uvicorn's HTTP/1.1 (h11) protocol with connection deadlines, and its configuration.

uvicorn bounds a request head's size (``h11_max_incomplete_event_size``) but not the time it takes: a client
that sends a head a byte at a time, or connects and sends nothing, holds a connection for ever; so does one
that keeps sending a body the app answered without reading (a 401, 413 or 408), since uvicorn reads and drops
the rest, at whatever rate the client sends. :class:`GuardedH11Protocol` closes a connection whose request head
is not complete within ``Settings.header_timeout`` of the connection (or of the previous answer). An answer sent
while the request's body is still arriving says ``Connection: close`` (a keep-alive client then opens a new
connection for its next request instead of sending it where nothing will read it); after it, the connection is
half-closed and the rest of the body read and dropped, for up to :data:`LINGER_SECONDS` and
:data:`LINGER_BYTES`, so that the client reads the answer and the end of the connection rather than a reset;
a client still sending after that is reset. A client that stops reading an answer for ``Settings.body_timeout``
loses its connection too: an answer held unsent holds its share of the in-flight budget
(:mod:`plancache.server.limits`). A body the app reads has its own deadline (:mod:`plancache.server.bodies`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..settings import ServerSettings

#: Largest request head (request line and headers) uvicorn's h11 parser buffers, in bytes.
MAX_HEAD_BYTES = 16 * 1024
#: Seconds, and bytes, of a request body that arrive after the answer that are read and dropped before the
#: connection is reset (the answer said ``Connection: close``; the client is expected to stop sending).
LINGER_SECONDS = 1.0
LINGER_BYTES = 4 * 1024 * 1024
CONNECTION_CLOSE = (b"connection", b"close")


class ClosingH11Connection(h11.Connection):
    """h11's connection that adds ``Connection: close`` to an answer sent while the request's body is still
    arriving: the body is not read further, so the connection cannot carry another request."""

    def send(self, event: h11.Event) -> bytes | None:  # type: ignore[override]  # h11's overloads, one body
        if isinstance(event, h11.Response) and self.their_state is h11.SEND_BODY:
            event = h11.Response(status_code=event.status_code, reason=event.reason, http_version=event.http_version,
                                 headers=[*event.headers.raw_items(), CONNECTION_CLOSE])
        return super().send(event)


class _LingeringTransport(asyncio.Transport):
    """The connection's transport as uvicorn sees it: its :meth:`close` is the protocol's (a lingering close
    while the request's body is still arriving); everything else is the socket transport's."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        super().__init__()
        self.raw, self._protocol = transport, protocol

    def close(self) -> None:
        self._protocol.close_connection()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self.raw.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.raw.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self.raw.writelines(list_of_data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.raw.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self.raw.pause_reading()

    def resume_reading(self) -> None:
        self.raw.resume_reading()

    def is_reading(self) -> bool:
        return self.raw.is_reading()

    def abort(self) -> None:
        self.raw.abort()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.raw.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.raw.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self.raw.get_write_buffer_size()

    def can_write_eof(self) -> bool:
        return self.raw.can_write_eof()

    def write_eof(self) -> None:
        self.raw.write_eof()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on a request's head, ``Connection: close`` on an answer sent before
    its request's body was read, and a bounded lingering close after it (the module docstring)."""

    header_timeout: float = 10.0
    write_timeout: float = 15.0

    _guard: asyncio.TimerHandle | None = None
    _phase: str | None = None
    _write_guard: asyncio.TimerHandle | None = None
    lingering: bool = False
    _lingered_bytes: int = 0

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.conn = ClosingH11Connection(h11.SERVER, config.h11_max_incomplete_event_size or MAX_HEAD_BYTES)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))
        _no_delay(transport)
        self._update_guard()

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # the rest of a body after its answer: dropped, up to LINGER_BYTES
            self._lingered_bytes += len(data)
            if self._lingered_bytes > LINGER_BYTES:
                self._drop(f"the client sent more than {LINGER_BYTES} bytes after its answer")
            return
        super().data_received(data)
        self._update_guard()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_guard()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_guard(None)
        if self._write_guard is not None:
            self._write_guard.cancel()
            self._write_guard = None
        super().connection_lost(exc)

    def close_connection(self) -> None:
        """Close the connection; while the request's body is still arriving, linger: the answer is flushed and
        the connection half-closed, and what the client still sends is read and dropped until it closes its
        side, for up to :data:`LINGER_SECONDS` and :data:`LINGER_BYTES` (then the connection is reset)."""
        raw = self._raw()
        if self.lingering or raw.is_closing():
            return
        if self.conn.their_state is not h11.SEND_BODY:
            raw.close()
            return
        self.lingering = True
        self._set_guard(None)
        raw.write_eof()  # after what is buffered: the client reads the answer, then the end of the connection
        raw.resume_reading()
        self._guard = self.loop.call_later(LINGER_SECONDS, self._drop,
                                           f"the client was still sending its body {LINGER_SECONDS} s after its answer")

    def _raw(self) -> asyncio.Transport:
        transport = self.transport
        return transport.raw if isinstance(transport, _LingeringTransport) else transport

    def _drop(self, why: str) -> None:
        self.logger.debug("resetting a connection: %s", why)
        _reset(self._raw())

    def pause_writing(self) -> None:
        """The client is not reading what was written: it has ``write_timeout`` to start again."""
        super().pause_writing()
        if self._write_guard is None:
            self._write_guard = self.loop.call_later(self.write_timeout, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_guard is not None:
            self._write_guard.cancel()
            self._write_guard = None

    def _write_stalled(self) -> None:
        self._write_guard = None
        if self.transport is not None:
            self._drop(f"the client has not read its answer for {self.write_timeout} s")

    def _update_guard(self) -> None:
        """The head's deadline runs from the connection (or the previous answer) while no request head is in;
        more bytes do not extend it."""
        if self.transport is None or self.transport.is_closing():
            return
        phase = "head" if self.conn.their_state is h11.IDLE else None
        if phase != self._phase:
            self._set_guard(phase)

    def _set_guard(self, phase: str | None) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None
        self._phase = phase
        if phase == "head":
            self._guard = self.loop.call_later(self.header_timeout, self._expire)

    def _expire(self) -> None:
        self._guard = None
        if self._phase == "head" and self.transport is not None and not self.transport.is_closing():
            self.logger.debug("closing a connection: request head not complete in time")
            raw = self._raw()
            raw.close()  # if the client does not read what is buffered either:
            self.loop.call_later(LINGER_SECONDS, _reset, raw)


def _no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on the connection. asyncio sets it only on sockets made with ``proto=IPPROTO_TCP``; a listening
    socket made with ``socket.socket(AF_INET, SOCK_STREAM)`` (proto 0, as ``plancache serve`` binds one) hands out
    connections without it, and an answer written in two parts (head, body) then waits for the client's delayed
    ACK: 40 ms on Linux per request."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _reset(transport: asyncio.Transport) -> None:
    """Drop the connection with a TCP reset: close() would wait to flush what the client does not read, and a
    plain close leaves the kernel sending the socket's buffer out at the client's pace."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def guarded_protocol(settings: ServerSettings) -> type[GuardedH11Protocol]:
    """:class:`GuardedH11Protocol` with ``settings.header_timeout`` and (for answers) ``settings.body_timeout``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": float(settings.header_timeout),
                                                              "write_timeout": float(settings.body_timeout)})


def uvicorn_config(app: Any, settings: ServerSettings, *, host: str = "127.0.0.1", port: int = 8787,
                   **options: Any) -> uvicorn.Config:
    """The uvicorn configuration ``plancache serve`` runs ``app`` with (tests' live servers too): the guarded h11
    protocol, ``Settings.keep_alive_timeout``, a 16 KiB request head, no proxy headers; ``options`` override."""
    kwargs: dict[str, Any] = {
        "host": host, "port": port, "http": guarded_protocol(settings), "timeout_keep_alive": settings.keep_alive_timeout,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES, "proxy_headers": False,
    }
    kwargs.update(options)
    return uvicorn.Config(app, **kwargs)

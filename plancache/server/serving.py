"""How the app is served: uvicorn's HTTP/1.1 (h11) protocol with connection deadlines, and its configuration.

uvicorn bounds a request head's size (``h11_max_incomplete_event_size``) but not the time it takes: a client
that sends a head a byte at a time, or connects and sends nothing, holds a connection for ever; so does one
that keeps sending a body the app answered without reading (a 401, 413 or 408), since uvicorn reads and drops
the rest, at whatever rate the client sends. :class:`GuardedH11Protocol` closes a connection whose request head
is not complete within ``Settings.header_timeout`` of the connection (or of the previous answer); after an
answer to a request whose body is still arriving it stops reading and closes the connection
:data:`LINGER_SECONDS` later (the client has the answer; reading more would cost CPU for nothing). A client that
stops reading an answer for ``Settings.body_timeout`` loses its connection too: an answer held unsent holds its
share of the in-flight budget (:mod:`plancache.server.limits`). A body the app reads has its own deadline
(:mod:`plancache.server.bodies`).
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
#: Seconds a connection stays open, not read, after an answer to a request whose body was not read.
LINGER_SECONDS = 1.0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on a request's head, and on the unread body after an early answer."""

    header_timeout: float = 10.0
    write_timeout: float = 15.0

    _guard: asyncio.TimerHandle | None = None
    _phase: str | None = None
    _write_guard: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _no_delay(transport)
        self._update_guard()

    def data_received(self, data: bytes) -> None:
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
        if self.transport is not None and not self.transport.is_closing():
            self.logger.debug("closing a connection: the client has not read its answer for %.1f s", self.write_timeout)
        if self.transport is not None:
            _reset(self.transport)

    def _current_phase(self) -> str | None:
        """``head`` (waiting for a request head), ``drain`` (answered, the client still sends the body) or None
        (the app has the request: its own deadlines apply)."""
        their = self.conn.their_state
        if their is h11.IDLE:
            return "head"
        if their is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete:
            return "drain"
        return None

    def _update_guard(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        phase = self._current_phase()
        if phase != self._phase:  # a deadline runs from the start of its phase: more bytes do not extend it
            self._set_guard(phase)

    def _set_guard(self, phase: str | None) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None
        self._phase = phase
        if phase == "head":
            self._guard = self.loop.call_later(self.header_timeout, self._expire, phase)
        elif phase == "drain":
            self.transport.pause_reading()  # the rest of the body is never read: do not spend CPU dropping it
            self._guard = self.loop.call_later(LINGER_SECONDS, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._guard = None
        if self._phase == phase and self.transport is not None and not self.transport.is_closing():
            self.logger.debug("closing a connection: %s", "request head not complete in time" if phase == "head"
                              else "answered before its body was read")
            self.transport.close()  # the answer written is flushed first; if the client does not read it either:
            self.loop.call_later(LINGER_SECONDS, _reset, self.transport)


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

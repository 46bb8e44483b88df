"""Plain static file servers for the benchmarks: no plancache code, they stand for nginx, a bucket or a CDN.

    python bench/static_server.py DIRECTORY --port N [--asyncio]

By default Python's ``http.server`` (a thread per connection, HTTP/1.1 keep-alive, no logging); with ``--asyncio`` a
small event-loop server that answers ``GET`` (and ``HEAD``) of the files under ``DIRECTORY`` with ``Content-Length``
and keep-alive, reading each file as it is asked for, and 404 for anything else: closer to what a real static server
costs per request, though still Python.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024  # a start-up storm's connections (5 by default)


#: Files read, by path: ((mtime_ns, size), bytes).
FILES: dict[str, tuple[tuple[int, int], bytes]] = {}


class Static(asyncio.Protocol):
    """One connection: requests parsed from the buffer (no bodies), answered in order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def read(self, path: str) -> bytes | None:
        """The bytes of the file ``path``, kept while its size and modification time stay the same."""
        try:
            st = os.stat(path)
            held = FILES.get(path)
            if held is None or held[0] != (st.st_mtime_ns, st.st_size):
                with open(path, "rb") as f:
                    held = FILES[path] = ((st.st_mtime_ns, st.st_size), f.read())
        except OSError:
            return None
        return held[1]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, self.buffer = self.buffer[:end].decode("latin-1"), self.buffer[end + 4:]
            method, target, _ = (head.split("\r\n", 1)[0].split(" ") + ["", ""])[:3]
            close = "connection: close" in head.lower()
            self.transport.write(self.answer(method, target, close))
            if close:
                self.transport.close()
                return

    def answer(self, method: str, target: str, close: bool) -> bytes:
        name = os.path.normpath(unquote(urlsplit(target).path)).lstrip("/")
        body = None
        if method in ("GET", "HEAD") and not name.startswith(".."):
            body = self.read(os.path.join(self.root, name))
        status = "200 OK" if body is not None else "404 Not Found"
        body = body if body is not None else b"not found"
        head = (f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nContent-Type: application/octet-stream\r\n"
                f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n").encode()
        return head + (body if method != "HEAD" else b"")


async def serve_asyncio(root: Path, port: int) -> None:
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(partial(Static, root.resolve()), "127.0.0.1", port, backlog=1024)
    await srv.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--asyncio", action="store_true", help="the event-loop server, not http.server")
    args = parser.parse_args()
    if args.asyncio:
        asyncio.run(serve_asyncio(Path(args.directory), args.port))
    else:
        os.chdir(args.directory)
        Server(("127.0.0.1", args.port), partial(Handler, directory=args.directory)).serve_forever()


if __name__ == "__main__":
    main()

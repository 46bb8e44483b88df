"""The files under a static index's URL (:mod:`plancache.client.index`): a folder, or an http(s) prefix read without
credentials."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit
from urllib.request import url2pathname

from ..errors import PlanCacheError, ServerUnavailable

if TYPE_CHECKING:
    import httpx

    from ..http import HttpClient


class IndexSource:
    """The files under an index URL: ``file:///path``, or ``http(s)://host/prefix`` read without credentials. A
    missing file is None; anything else that fails is :class:`~plancache.errors.ServerUnavailable`."""

    def __init__(self, url: str, *, connect_timeout: float, read_timeout: float, cooldown: float,
                 sets: tuple[str, ...] = (), max_blob_bytes: int = 64 << 20,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        #: The largest blob read (``PLANCACHE_MAX_BLOB_BYTES``).
        self.max_blob_bytes = max_blob_bytes
        #: The named sets read first.
        self.sets = sets
        parts = urlsplit(url)
        self._folder: Path | None = None
        self._http: HttpClient | None = None
        if parts.scheme == "file":
            if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
                raise ValueError(f"index URL {url!r}: a folder is file:///absolute/path")
            self._folder = Path(url2pathname(parts.path))
        elif parts.scheme in ("http", "https"):
            from ..http import CircuitBreaker, HttpClient

            self._http = HttpClient(self.url, None, policies=[CircuitBreaker(cooldown)],
                                    connect_timeout=connect_timeout, read_timeout=read_timeout, transport=transport)
        else:
            raise ValueError(f"index URL {url!r}: use http(s)://host/prefix (a bucket's public URL, a CDN) or "
                             "file:///absolute/path")

    def get(self, name: str, max_bytes: int, deadline: float) -> bytes | None:
        """The bytes of ``name`` under the URL, at most ``max_bytes`` (more: ServerUnavailable), by ``deadline``."""
        if self._folder is not None:
            from ..files import read_limited

            try:
                return read_limited(self._folder / name, max_bytes, planted=True)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise ServerUnavailable(f"index {self._folder / name}: {exc.strerror or exc}") from None
        assert self._http is not None
        try:
            return self._http.read("GET", f"/{name}", _body, max_bytes=max_bytes, deadline=deadline)
        except PlanCacheError as exc:
            if exc.http_status == 404:
                return None
            raise

    def close(self) -> None:
        if self._http is not None:
            self._http.close()


def _body(resp: httpx.Response) -> bytes:
    if resp.status_code != 200:
        raise ValueError(f"{resp.status_code} {resp.reason_phrase}, not 200 with the file")
    return resp.content


def make_source(url: str, sets: str | None, *, connect_timeout: float, read_timeout: float, cooldown: float,
                max_blob_bytes: int, transport: httpx.BaseTransport | None = None) -> IndexSource:
    """The :class:`IndexSource` of ``PLANCACHE_INDEX_URL`` and ``PLANCACHE_INDEX_SETS`` (names separated by ``,``);
    ValueError naming the problem for a bad URL or set name."""
    import re

    from ..index import SET_NAME_PATTERN

    names = tuple(dict.fromkeys(n.strip() for n in (sets or "").split(",") if n.strip()))
    bad = [n for n in names if not re.match(SET_NAME_PATTERN, n)]
    if bad:
        raise ValueError(f"index sets {bad[0][:80]!r}: a set name is letters, digits, '.', '_' and '-' (at most 128)")
    return IndexSource(url, connect_timeout=connect_timeout, read_timeout=read_timeout, cooldown=cooldown,
                       sets=names, max_blob_bytes=max_blob_bytes, transport=transport)

"""Blobs read from a plancache server's ``GET /v1/blobs/{sha256}`` (read-only), checked against their name."""

from __future__ import annotations

from collections.abc import Iterator

from .._httpx import httpx
from ..errors import IntegrityError, ServerUnavailable
from ..http import IDENTITY, check_url, error_from_response, refuse_encoded, tls_verification
from ..settings import BlobLimitSettings
from .base import CHUNK_BYTES, BlobReader, BlobStream, check_name

#: The largest blob read by default: the most a server accepts.
DEFAULT_MAX_BYTES: int = BlobLimitSettings.model_fields["max_blob_bytes"].default


class HttpBlobs(BlobReader):
    """The blobs a server at ``url`` serves, with ``token`` (a reader's) when reads need one. An answer over
    ``max_bytes`` is refused; one that does not hash to its name is never completed (see :class:`BlobStream`);
    one content-encoded (identity is asked for) is refused unread. Transport failures, 429, 5xx and encoded
    answers are :class:`~plancache.errors.ServerUnavailable`; other refusals the error of their code."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.url = check_url(url)
        self.max_bytes = max_bytes
        headers = {**IDENTITY, "Authorization": f"Bearer {token}"} if token else dict(IDENTITY)
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                    verify=tls_verification(self.url), follow_redirects=False)

    def _send(self, sha256: str) -> httpx.Response | None:
        request = self._client.build_request("GET", f"/v1/blobs/{check_name(sha256)}")
        try:
            resp = self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"GET {request.url}: {type(exc).__name__}: {exc}") from None
        try:  # before any body is read, an error answer's too
            refuse_encoded(resp, f"GET {request.url}")
        except ServerUnavailable:
            resp.close()
            raise
        if resp.status_code == 404:
            resp.close()
            return None
        if resp.status_code >= 400:
            resp.read()
            resp.close()
            raise error_from_response(resp)
        return resp

    def _size(self, resp: httpx.Response) -> int:
        try:
            size = int(resp.headers["Content-Length"])
        except (KeyError, ValueError):
            resp.close()
            raise ServerUnavailable(f"GET {resp.request.url}: the answer has no valid Content-Length") from None
        if size > self.max_bytes:
            resp.close()
            raise IntegrityError(f"GET {resp.request.url}: the blob has {size} bytes, more than {self.max_bytes}")
        return size

    def size(self, sha256: str) -> int | None:
        resp = self._send(sha256)
        if resp is None:
            return None
        try:
            return self._size(resp)
        finally:
            resp.close()

    def open(self, sha256: str) -> BlobStream | None:
        resp = self._send(sha256)
        if resp is None:
            return None
        size = self._size(resp)

        def pieces() -> Iterator[bytes]:
            got = 0
            try:
                for piece in resp.iter_bytes(CHUNK_BYTES):
                    got += len(piece)
                    if got > size:
                        raise IntegrityError(f"GET {resp.request.url}: more bytes than its Content-Length ({size})")
                    yield piece
            except httpx.TransportError as exc:
                raise ServerUnavailable(f"GET {resp.request.url}: {type(exc).__name__}: {exc}") from None

        return BlobStream(sha256, size, pieces(), resp.close, source=self.url)

    def close(self) -> None:
        self._client.close()

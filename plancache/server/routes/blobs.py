"""Blob uploads: ``PUT /v1/blobs/{sha256}`` (raw bytes, streamed into the blob store) and ``HEAD`` (is it there).

A worker uploads the blob of a job it holds (headers ``X-Plancache-Job``, ``X-Plancache-Worker`` and
``X-Plancache-Lease``: the claim's job id, worker id and lease token, checked as heartbeat checks them), then
publishes the record alone (``PUT /v1/plans`` or ``POST /v1/jobs/{id}/complete``). An admin
may upload any blob; readers none. ``GET`` is :mod:`.plans`'s.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio.from_thread
import anyio.to_thread
from fastapi import APIRouter, Header, Path, Response
from starlette.concurrency import run_in_threadpool

from ...errors import Forbidden, InvalidValue, LengthRequired, NotFound
from ...protocol import SHA256_PATTERN, is_job_id
from ..auth import Reader, Worker
from ..bodies import CheckedRequest, CheckedRoute
from ..deps import StoreDep
from ..errors import documented_errors
from .plans import BLOB_ROUTE

router = APIRouter(route_class=CheckedRoute, tags=["blobs"])

Sha256Path = Annotated[str, Path(pattern=SHA256_PATTERN)]


class _Body:
    """A body's chunks as a blocking binary stream, for a worker thread of anyio's (each read waits on the event
    loop for the next chunk): the bytes go to the blob store as they arrive, never whole in memory."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = b""

    async def _next(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            return b""

    def read(self, n: int = -1) -> bytes:
        while not self._pending:
            self._pending = anyio.from_thread.run(self._next)
            if not self._pending:
                return b""
        piece, self._pending = (self._pending, b"") if n < 0 else (self._pending[:n], self._pending[n:])
        return piece


@router.put(BLOB_ROUTE, status_code=201, response_class=Response, summary="Upload a plan blob (raw bytes)",
            openapi_extra={"requestBody": {"required": True,
                                           "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                                 "format": "binary"}}}}},
            responses={200: {"description": "the blob was stored already"},
                       201: {"description": "the blob is stored"},
                       **documented_errors(401, 403, 404, 408, 409, 411, 413, 422, 503, 507)})
async def put_blob(sha256: Sha256Path, request: CheckedRequest, store: StoreDep, principal: Worker,
                   x_plancache_job: Annotated[str | None, Header(description="the held job's id")] = None,
                   x_plancache_worker: Annotated[str | None, Header(description="the lease's worker id")] = None,
                   x_plancache_lease: Annotated[str | None, Header(description="the claim's lease token")] = None
                   ) -> Response:
    """The body is the blob's bytes (``application/octet-stream``, with ``Content-Length``: 411 without), streamed
    into the blob store with its digest checked while it is written: 422 ``integrity_error`` when the bytes do not
    hash to ``sha256`` (nothing is stored). Over ``PLANCACHE_MAX_BLOB_BYTES`` is 413 from the declared length, before
    the body is read; the body is read within the server's body deadline (408) and, at its declared length, the
    in-flight budget (503 ``server_busy`` with ``Retry-After`` when it stays full). 201 when stored, 200 when it was
    there. A worker token needs the headers of a job it holds (403 without them; 409 ``lease_lost`` or 403
    ``not_lease_holder`` as heartbeat answers); an admin token none."""
    if not principal.may("admin"):
        job_id = int(x_plancache_job) if x_plancache_job and re.fullmatch("[0-9]{1,10}", x_plancache_job) else 0
        if not is_job_id(job_id) or not x_plancache_lease:
            raise Forbidden(f"token {principal.name!r} has role {principal.role}: a worker uploads blobs only for a "
                            "job it holds (headers X-Plancache-Job: its id, X-Plancache-Worker, X-Plancache-Lease)")
        await run_in_threadpool(store.check_held, job_id, x_plancache_worker, x_plancache_lease,
                                holder=principal.identity, completing=True)
    # A chunked body is refused rather than read with a running cap: the catalog row, its size included, is written
    # before the bytes, and the size decides the 413 and the in-flight share before a byte is read. Every client
    # knows a blob's size before sending it (plancache's sends Content-Length always).
    content_length = await request.admit()  # 413 over the limit; waits for room in the budget, else 503
    if content_length is None:
        raise LengthRequired("send the blob with a Content-Length header (its size in bytes)")
    if content_length == 0:
        raise InvalidValue("a blob cannot be empty: a serialized plan has bytes")
    body: Any = _Body(request.chunks())
    created = await anyio.to_thread.run_sync(store.store_blob, sha256, content_length, body,
                                             limiter=request.app.state.upload_threads)
    return Response(status_code=201 if created else 200, headers={"ETag": f'"{sha256}"'})


@router.head(BLOB_ROUTE, response_class=Response, summary="Whether a blob is stored, and its size",
             responses={200: {"description": "stored: Content-Length is its size"},
                        **documented_errors(401, 403, 404, 422, 503)})
async def head_blob(sha256: Sha256Path, store: StoreDep, _: Reader) -> Response:
    """200 with ``Content-Length`` (the blob's size) and ``ETag``, no body; 404 when absent."""
    size = await run_in_threadpool(store.blob_size, sha256)
    if size is None:
        raise NotFound(f"no blob {sha256}")
    return Response(status_code=200, headers={"Content-Length": str(size), "ETag": f'"{sha256}"'})

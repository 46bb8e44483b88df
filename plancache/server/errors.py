"""The one mapping from errors to HTTP responses. Every error body is ``{"error": {"code", "message"}}``.

Domain errors (:class:`plancache.errors.PlanCacheError`) carry their own ``http_status`` and ``code``;
request validation becomes 422 ``validation_error`` naming the field; what the framework refuses (an unknown
path, a body it cannot parse) keeps its status and takes the code of the class for it; an unreachable or locked
database is a retryable 503; a blob store that cannot take a write (full disk or quota, folder not writable:
:data:`STORAGE_ERRNOS`) is 507 ``insufficient_storage``, logged in one line (the write is atomic and inside the
record's transaction: nothing half-written stays); anything else is a bug, logged with its traceback and answered
500 ``internal_error`` with ``Connection: close``.

A refused request (422) is logged in one line, never with a traceback. Those lines and the tracebacks of 500s are
bounded per client (its token, else its address: :data:`CLIENT_LOG_BURST`, then :data:`CLIENT_LOG_LINES_PER_MINUTE`);
the lines left out are counted in the client's next line.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Mapping
from typing import Any

import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import (
    BadRequest,
    Forbidden,
    LengthRequired,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    PlanCacheError,
    RequestTimeout,
    RetryLater,
    ServerBusy,
    TooManyRequests,
    Unauthorized,
    UnsupportedMediaType,
)
from ..protocol import ErrorResponse
from ..validation import validation_message
from .auth import PRINCIPAL_SCOPE_KEY
from .limits import LogBudget, rate_key

log = logging.getLogger("plancache.server")

#: The error each status means when the framework answers it (an unknown path, an unparsable body); plancache's
#: own code raises :mod:`plancache.errors` classes, never ``HTTPException``.
_FRAMEWORK_ERRORS: dict[int, type[PlanCacheError]] = {
    e.http_status: e for e in (BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed, RequestTimeout,
                               LengthRequired, PayloadTooLarge, UnsupportedMediaType, TooManyRequests, ServerBusy)}
#: ``OSError`` numbers that mean the blob store cannot take a write now: full disk or quota, read-only or
#: unwritable folder, a file where a shard folder goes (or a folder where a blob goes). An operator's fix; the
#: request may succeed later.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
                            errno.ENOTDIR, errno.EISDIR})
#: The status counted for a request whose client went away before its body arrived (nginx's; nothing is sent).
CLIENT_CLOSED_REQUEST = 499
#: Longest error message answered (a message may quote what the request sent).
MAX_MESSAGE_CHARS = 2000

#: Log lines a client's refused requests and server errors may write: this many at once, then per minute.
CLIENT_LOG_BURST = 20
CLIENT_LOG_LINES_PER_MINUTE = 10

_DOCUMENTED = {
    400: "malformed, or signed by no key the server trusts (a withdrawal)",
    401: "missing, malformed, unknown or revoked token",
    403: "the token's role may not do this",
    404: "not found",
    409: "conflicts with stored state",
    411: "no Content-Length: send the size of the body",
    408: "the request body did not arrive in time",
    413: "request or blob too large",
    415: "the body is not JSON sent with Content-Type: application/json",
    422: "invalid request (the message names the field)",
    429: "this token's budget for the operation is spent; retry after Retry-After seconds",
    503: "database or blob store unavailable, or the server is busy; retry after Retry-After seconds",
    507: "the blob store is full or not writable; nothing was stored, retry later",
}


def documented_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses (all with the error body)."""
    return {s: {"model": ErrorResponse, "description": _DOCUMENTED[s]} for s in statuses}


def error_response(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "…"
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=dict(headers or {}))


def _headers(exc: PlanCacheError) -> dict[str, str]:
    """The headers an error's status asks for: the scheme of a 401, the methods of a 405, when to retry a 429/503."""
    if exc.http_status == 401:
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, MethodNotAllowed):
        return {"Allow": ", ".join(exc.allowed)}
    if isinstance(exc, RetryLater):
        return {"Retry-After": str(exc.retry_after)}
    return {"Retry-After": "1"} if exc.http_status == 503 else {}


#: Error codes of a request the blob store failed (counted in ``plancache_blob_store_errors_total{code}``).
BLOB_STORE_CODES = frozenset({"blob_store_unavailable", "blob_store_mismatch", "insufficient_storage"})


def _blob_store_failed(request: Request, code: str) -> None:
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None and code in BLOB_STORE_CODES:
        metrics.blob_store_errors.labels(code).inc()


def _client(request: Request) -> str:
    """Whose log budget a request's lines take from: its token's (as the rate limits key it), else its address."""
    principal = request.scope.get(PRINCIPAL_SCOPE_KEY)
    if principal is not None:
        return rate_key(principal)
    return f"address:{request.client.host if request.client else 'unknown'}"


def _log_admitted(request: Request) -> str | None:
    """None when the client's log budget is spent (the line is counted, not written); else a suffix naming the
    client and the lines of it left out before."""
    budget: LogBudget | None = getattr(request.app.state, "client_logs", None)
    client = _client(request)
    left_out = budget.admit(client) if budget is not None else 0
    if left_out is None:
        return None
    return f" [{client}" + (f"; {left_out} earlier line(s) of it left out]" if left_out else "]")


def _log_refusal(request: Request, status: int, message: str) -> None:
    suffix = _log_admitted(request)
    if suffix is not None:
        log.info("refused %s %s: %d %s%s", request.method, request.url.path, status, message[:300], suffix)


async def _domain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PlanCacheError)
    _blob_store_failed(request, exc.code)
    if exc.http_status == 422:
        _log_refusal(request, 422, exc.message)
    return error_response(exc.http_status, exc.code, exc.message, _headers(exc))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message = validation_message(exc.errors()) or "invalid request"
    _log_refusal(request, 422, message)
    return error_response(422, "validation_error", message)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    """An error the framework raised, answered as the class of its status (:data:`_FRAMEWORK_ERRORS`)."""
    assert isinstance(exc, StarletteHTTPException)
    error = _FRAMEWORK_ERRORS.get(exc.status_code)
    code = error.code if error is not None else f"http_{exc.status_code}"
    return error_response(exc.status_code, code, str(exc.detail), exc.headers)


async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable during %s %s: %s", request.method, request.url.path, type(exc).__name__)
    return error_response(503, "database_unavailable", "the database is unavailable or busy; retry later",
                          {"Retry-After": "1"})


async def _storage_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OSError)
    if request.method == "PUT" and exc.errno == errno.ENOENT:  # the file being written vanished under the writer
        log.error("blob store lost a file while %s %s was written: %s", request.method, request.url.path, exc)
        _blob_store_failed(request, "blob_store_unavailable")
        return error_response(503, "blob_store_unavailable", "the blob's file was removed while it was written (a "
                              "`plans gc` whose grace is shorter than an upload?); nothing was stored, retry",
                              {"Retry-After": "1"})
    if exc.errno not in STORAGE_ERRNOS:
        return await _internal_error(request, exc)
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    if request.method != "PUT":  # a read (the write routes are PUTs): the store is there, not readable now
        log.error("blob store cannot be read during %s %s: %s (%s)", request.method, request.url.path, name, exc)
        _blob_store_failed(request, "blob_store_unavailable")
        return error_response(503, "blob_store_unavailable", f"the server's blob store cannot be read now ({name}: "
                              f"{exc.strerror}); retry later", {"Retry-After": "1"})
    log.error("blob store cannot take a write during %s %s: %s (%s)", request.method, request.url.path, name, exc)
    _blob_store_failed(request, "insufficient_storage")
    return error_response(507, "insufficient_storage", f"the server's blob store cannot store this now ({name}: "
                          f"{exc.strerror}); nothing was stored, retry later")


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client closed the connection before its body arrived (a worker killed mid-upload, a client that gave up):
    nobody to answer, nothing stored. 499, nginx's "client closed request", is what the metrics count."""
    log.info("client went away during %s %s before its body arrived", request.method, request.url.path)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    suffix = _log_admitted(request)
    if suffix is not None:
        log.error("unhandled error in %s %s%s", request.method, request.url.path, suffix, exc_info=exc)
    # uvicorn drops the connection after this answer (the error propagates to it): say so, or a keep-alive
    # client would send its next request there
    return error_response(500, "internal_error", "internal server error (logged)", {"Connection": "close"})


def install_error_handlers(app: FastAPI) -> None:
    app.state.client_logs = LogBudget(CLIENT_LOG_LINES_PER_MINUTE, CLIENT_LOG_BURST)
    app.add_exception_handler(PlanCacheError, _domain_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for exc_type in (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, sqlalchemy.exc.TimeoutError):
        app.add_exception_handler(exc_type, _database_unavailable)
    app.add_exception_handler(OSError, _storage_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _internal_error)

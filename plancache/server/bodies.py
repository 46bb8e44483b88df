"""Request bodies and URLs, checked before any parsing, and parsed off the event loop.

Every route of the app uses :class:`CheckedRoute`. For a route that takes a body, before FastAPI sees it:

1. the caller's token is checked (:func:`plancache.server.auth.authorize_off_loop`): a caller without the route's
   role gets its 401/403 before a byte of the body is read;
2. the body is read within its route's size limit (the declared ``Content-Length`` first, then what
   arrives): ``Settings.max_json_bytes`` (1 MiB; a spec is kilobytes), and for a plan upload
   (:data:`RECORD_ROUTES`: its record, its candidates table and maybe its spec; the blob is uploaded raw before)
   as much again as the record and the table may take, never over ``Settings.max_request_bytes``, else 413 (from
   the declared length: before the body is read); within its deadline, ``Settings.body_timeout`` plus its size at
   ``Settings.body_min_rate``, else 408 (a slow drip is cut); and within the process's in-flight budget
   (:class:`~plancache.server.limits.ByteBudget`), waiting briefly for room, else 503 with ``Retry-After``;
3. it is parsed as strict JSON and validated against the route's body model in a worker thread, at most
   ``Settings.body_parse_threads`` at once, so the event loop keeps answering (``/healthz``) meanwhile; a body
   of at most :data:`INLINE_PARSE_BYTES` on the event loop (the hand-off would cost more).
   FastAPI then gets the validated model and does not validate it again.

A raw blob upload (:data:`RAW_UPLOAD_ROUTES`) is not parsed: its handler streams the body into the blob store
(:meth:`CheckedRequest.chunks`) under its own size limit (``Settings.max_blob_bytes``), the same deadline and
budget, after its own checks of the token and the job.

Strict JSON refuses what Python's ``json`` accepts but the store cannot keep or the wire models
cannot round-trip: ``NaN``/``Infinity`` and overflowing floats, integers of more than
:data:`MAX_INT_CHARS` characters (no field takes more than a 64-bit integer; refused before Python converts
it, so a 4,000-digit number costs nothing), NUL characters in strings (PostgreSQL text cannot hold them),
bytes that are not UTF-8 and arrays or objects nested more than :data:`MAX_BODY_DEPTH` deep (checked by a loop,
not a recursion: every later walk of the value stays far from Python's recursion limit); a NUL in the query string
is refused too. Each is a 422. A route with a per-token budget (:data:`CHARGED_ROUTES`) takes from it before the
body is read, so a body refused costs its caller as much as one taken.
"""

from __future__ import annotations

import asyncio
import email.message
import json
import math
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, ClassVar

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.routing import Match, compile_path
from starlette.types import Receive, Scope, Send

from ..errors import (
    InvalidValue,
    MethodNotAllowed,
    PayloadTooLarge,
    RequestTimeout,
    TooManyRequests,
    UnsupportedMediaType,
)
from ..protocol import MAX_CANDIDATES_BYTES, MAX_RECORD_BYTES, Role
from ..store.blobs import DatabaseBlobs
from ..validation import INT64_MAX
from .auth import authorize_off_loop
from .deps import get_store
from .errors import documented_errors
from .limits import rate_key

_ESCAPED_NUL = b"\\u0000"
# A \u0000 escape preceded by an even number of backslashes (an odd number escapes the backslash itself).
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")

#: Longest JSON integer accepted, in characters: -9223372036854775808 (int64's minimum) has 20.
MAX_INT_CHARS = 20
#: Deepest nesting of arrays and objects a body may have: a spec's deepest value
#: (:data:`plancache.spec.limits.MAX_DEPTH` levels of typed forms, each an object and an array) inside a tune
#: request's list of specs is under 24.
MAX_BODY_DEPTH = 32
#: A body of at most this many bytes is parsed and validated on the event loop, in less time than handing it to a
#: worker thread takes under load (a resolve of 49 keys, 4.5 KB: 0.1 ms; the worst 8 KiB, numbers: 1 ms).
INLINE_PARSE_BYTES = 8 * 1024
#: Routes whose body is a blob's raw bytes, streamed by the handler (:meth:`CheckedRequest.chunks`), up to
#: ``Settings.max_blob_bytes``. The in-flight budget counts such a body at its declared length, times
#: :data:`DATABASE_UPLOAD_FACTOR` when the blobs are rows of the database: a folder or a bucket holds a chunk or a
#: part of it at a time, the database store the whole blob and the driver's copy of it for the statement.
RAW_UPLOAD_ROUTES = frozenset({("PUT", "/v1/blobs/{sha256}")})
#: Routes whose body is a plan record, its tuning run's candidates table (up to ``MAX_CANDIDATES_BYTES``) and maybe
#: its spec: read up to ``Settings.max_json_bytes`` plus the bounds of the record and the table, so a table
#: :meth:`~plancache.protocol.CandidateTable.best_of` filled still fits beside a spec. The blob is not in it.
RECORD_ROUTES = frozenset({("PUT", "/v1/plans"), ("POST", "/v1/jobs/{job_id}/complete")})
#: Routes → the per-token budget (an ``app.state`` :class:`~plancache.server.limits.RateLimiter`) a call takes one
#: from, after its token is checked and before its body is read: a body refused (422) costs as much as one taken.
#: Admin tokens are not charged.
CHARGED_ROUTES = {("POST", "/v1/specs"): "spec_writes"}
#: Memory a blob upload into the database store takes per byte: the blob read whole, the driver's copy of the
#: statement's parameter, and the chunks joined on the way (measured: 2.8 bytes of memory per byte uploaded).
DATABASE_UPLOAD_FACTOR = 3
#: Memory a body takes while its request runs, per byte of body, as the in-flight budget counts it: parsed JSON
#: of small objects takes up to 25 times its text (measured: 1 MiB of ``{}`` → 25 MiB of dicts), plus the text.
JSON_MEMORY_FACTOR = 26


def _refuse(message: str) -> json.JSONDecodeError:
    return json.JSONDecodeError(message, "", 0)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _refuse(f"number {text[:40]} is out of range")
    return value


def _parse_int(text: str) -> int:
    if len(text) > MAX_INT_CHARS:
        raise _refuse(f"integer of {len(text)} characters is too long (at most {MAX_INT_CHARS}: no field takes "
                      "more than a 64-bit integer)")
    return int(text)


def _parse_constant(name: str) -> Any:
    raise _refuse(f"{name} is not valid JSON")


def _yield_point(obj: dict[str, Any]) -> dict[str, Any]:
    """``object_hook``: a Python call per JSON object, so a thread parsing a big body lets the event loop run."""
    return obj


def _has_escaped_nul(body: bytes | bytearray) -> bool:
    """Whether ``body`` holds ``\\u0000``, searched a MiB at a time (between searches, other threads may run)."""
    step = 1 << 20
    return any(body.find(_ESCAPED_NUL, i, i + step + len(_ESCAPED_NUL)) != -1 for i in range(0, len(body), step))


def _too_deep() -> json.JSONDecodeError:
    return _refuse(f"the body nests too deeply: arrays and objects more than {MAX_BODY_DEPTH} deep")


def _check_depth(value: Any, limit: int = MAX_BODY_DEPTH) -> None:
    """Refuse (``json.JSONDecodeError``) a value nesting lists and dicts more than ``limit`` deep, by a loop over
    an explicit stack: no recursion, whatever the depth."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth >= limit:
            raise _too_deep()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def strict_json_loads(body: bytes | bytearray) -> Any:
    """``json.loads`` refusing non-finite numbers, huge integers, NUL characters and nesting deeper than
    :data:`MAX_BODY_DEPTH` (``json.JSONDecodeError``).

    Each number and object is a Python call (the hooks): a thread parsing a big body of them lets others run."""
    if _has_escaped_nul(body) and _NUL_ESCAPE.search(body):
        raise _refuse("strings may not contain NUL characters (\\u0000)")
    try:
        value = json.loads(body, parse_float=_parse_float, parse_int=_parse_int, parse_constant=_parse_constant,
                           object_hook=_yield_point)
    except UnicodeDecodeError:
        raise _refuse("the body is not UTF-8 text") from None
    except RecursionError:
        raise _too_deep() from None
    _check_depth(value)
    return value


def _json_invalid(exc: json.JSONDecodeError) -> RequestValidationError:
    """The error FastAPI raises for a body that is not JSON (the same shape, so the same 422)."""
    return RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                    "input": {}, "ctx": {"error": exc.msg}}])


def _integral_floats_as_ints(value: Any) -> Any:
    """``value`` with every float that is a whole number as an int: JSON Schema's ``integer`` is any number
    without a fractional part (``5.0`` too), which pydantic's strict mode refuses."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    return value


def _strict_types(field: Any, value: Any) -> None:
    """Refuse (422) what pydantic's lax mode converts but the body's JSON schema does not allow: ``"5"`` or
    ``true`` for an integer, ``0`` or ``"yes"`` for a boolean, ``"1.5"`` for a number. The lax validation's
    result is what the route gets (a spec's ``1.0`` stays a float); this only checks the JSON types."""
    adapter: TypeAdapter[Any] = field._type_adapter  # FastAPI's adapter of the body parameter (its constraints)
    try:
        adapter.validate_python(_integral_floats_as_ints(value), strict=True)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


def _parse_and_validate(body: bytes, field: Any) -> Any:
    """Runs in a worker thread: the body parsed, and validated against ``field`` (FastAPI's body field) if given:
    as FastAPI does (lax), then its JSON types as the schema states them (:func:`_strict_types`)."""
    try:
        value = strict_json_loads(body)
    except json.JSONDecodeError as exc:
        raise _json_invalid(exc) from None
    if field is None:
        return value
    validated, errors = field.validate(value, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors)
    _strict_types(field, value)
    return validated


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI would parse a body of this content type as JSON (as its request handler decides)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _too_large(size: int, limit: int, why: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body of {size} bytes or more exceeds the limit of {limit} bytes ({why})")


def record_body_limit(settings: Any) -> int:
    """The body limit of a plan upload (:data:`RECORD_ROUTES`): ``max_json_bytes`` for its spec and the rest, plus
    :data:`~plancache.protocol.MAX_RECORD_BYTES` and :data:`~plancache.protocol.MAX_CANDIDATES_BYTES` (2.06 MiB by
    default), never over ``max_request_bytes``."""
    return min(int(settings.max_request_bytes), int(settings.max_json_bytes) + MAX_RECORD_BYTES + MAX_CANDIDATES_BYTES)


def _too_slow(received: int, seconds: float) -> RequestTimeout:
    return RequestTimeout(f"request body not received in time ({received} bytes in {seconds:.0f} s)")


class CheckedRequest(Request):
    """A request whose body is read within a size limit, a deadline and the in-flight budget, and parsed as
    strict JSON. :class:`CheckedRoute` sets the limit and releases the budget when the handler is done."""

    body_limit: int | None = None
    limit_reason: str = "PLANCACHE_MAX_REQUEST_BYTES"
    memory_factor: int = 1
    started: float = 0.0
    held_bytes: int = 0
    admitted: bool = False
    declared: int | None = None

    def _settings(self) -> Any:
        return self.app.state.settings

    def _limit(self) -> int:
        return self.body_limit if self.body_limit is not None else self._settings().max_request_bytes

    async def _take(self, n: int) -> None:
        """Count ``n`` more body bytes (times :attr:`memory_factor`) in the in-flight budget; a request can hold
        the whole budget, not more (it then runs alone)."""
        budget = getattr(self.app.state, "inflight", None)
        if budget is not None and n > 0:
            n = min(n * self.memory_factor, budget.capacity - self.held_bytes)
            if n > 0:
                await budget.take(n)
                self.held_bytes += n

    def release(self) -> None:
        budget = getattr(self.app.state, "inflight", None)
        if budget is not None:
            budget.release(self.held_bytes)
        self.held_bytes = 0

    async def admit(self) -> int | None:
        """The declared ``Content-Length`` (None for a chunked body), once: over the body limit it is 413 before a
        byte is read; else it is taken from the in-flight budget (waiting for room, else 503)."""
        if not self.admitted:
            limit = self._limit()
            declared_text = self.headers.get("content-length", "")
            if declared_text.isdigit():  # h11 has checked it is one number; it may still have 16,000 digits
                if len(declared_text) > 18 or int(declared_text) > limit:
                    raise _too_large(int(declared_text) if len(declared_text) <= 18 else limit + 1, limit,
                                     self.limit_reason)
                self.declared = int(declared_text)
                await self._take(self.declared)
            self.admitted = True
        return self.declared

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive, after :meth:`admit`: 413 once more than the body limit has come, 408
        past the body's deadline; a chunked body is taken from the in-flight budget chunk by chunk."""
        declared = await self.admit()
        settings, limit = self._settings(), self._limit()
        started = self.started or time.monotonic()
        total = 0
        stream = self.stream().__aiter__()
        while True:
            # the body's deadline: body_timeout, plus the time its bytes so far take at body_min_rate
            left = started + settings.body_timeout + total / max(settings.body_min_rate, 1) - time.monotonic()
            if left <= 0:
                raise _too_slow(total, time.monotonic() - started)
            try:
                async with asyncio.timeout(left):
                    chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _too_slow(total, time.monotonic() - started) from None
            total += len(chunk)
            if total > limit:
                raise _too_large(total, limit, self.limit_reason)
            if declared is None:
                await self._take(len(chunk))
            yield chunk

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            buffer = bytearray()  # grown in place: no whole-body copy on the event loop
            async for chunk in self.chunks():
                buffer += chunk
            self._body = buffer  # type: ignore[assignment]  # bytes-like: FastAPI and json.loads take a bytearray
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await run_parser(self.app, strict_json_loads, await self.body())
        return self._json


_LIMITERS: weakref.WeakKeyDictionary[Any, dict[asyncio.AbstractEventLoop, anyio.CapacityLimiter]] = (
    weakref.WeakKeyDictionary())


def _parse_limiter(app: Any) -> anyio.CapacityLimiter:
    """The app's limiter of parsing threads on the running event loop (a limiter belongs to one loop)."""
    per_app = _LIMITERS.setdefault(app, {})
    loop = asyncio.get_running_loop()
    limiter = per_app.get(loop)
    if limiter is None:
        for old in [lp for lp in per_app if lp.is_closed()]:
            del per_app[old]
        limiter = per_app[loop] = anyio.CapacityLimiter(max(1, app.state.settings.body_parse_threads))
    return limiter


async def run_parser(app: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a worker thread, at most ``Settings.body_parse_threads`` at once per process."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=_parse_limiter(app))


def _charge(request: Request, principal: Any, budget: str) -> None:
    """Take one from the caller's ``budget`` (:data:`CHARGED_ROUTES`); 429 with ``Retry-After`` when it is spent."""
    if principal.may("admin"):
        return
    limiter = getattr(request.app.state, budget)
    key = rate_key(principal)
    if not limiter.take(key):
        seconds = limiter.retry_after(key)
        raise TooManyRequests(f"token {principal.name!r} sent too many requests to {request.url.path}; retry in "
                              f"{seconds} s", retry_after=seconds)


def _required_role(dependant: Dependant) -> tuple[Role, bool] | None:
    """``(role, open_reads_apply)`` of the route's :func:`~plancache.server.auth.require` dependency, if any."""
    for dep in dependant.dependencies:
        role = getattr(dep.call, "plancache_role", None)
        if role is None:
            role = _required_role(dep)
        if role is not None:
            return role
    return None


class CheckedRoute(APIRoute):
    """An :class:`APIRoute` that refuses NUL in the query string and, for a route with a body, checks the token,
    reads the body and parses and validates it as described in the module docstring before FastAPI's handler."""

    #: The paths of every route made without parameters (``/v1/plans/resolve``).
    literal_paths: ClassVar[set[str]] = set()
    #: The methods of every route by path: a 405's ``Allow`` names them all when routes share a path (``/v1/blobs``).
    methods_by_path: ClassVar[dict[str, set[str]]] = {}

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if "{" not in path:
            CheckedRoute.literal_paths.add(path)
        if get_dependant(path=compile_path(path)[1], call=endpoint).body_params:  # what reading a body may answer
            kwargs["responses"] = {**documented_errors(408, 413, 415, 503), **(kwargs.get("responses") or {})}
        super().__init__(path, endpoint, **kwargs)
        CheckedRoute.methods_by_path.setdefault(self.path, set()).update(self.methods or ())

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.methods and scope["method"] not in self.methods:
            raise MethodNotAllowed(allowed=tuple(sorted(CheckedRoute.methods_by_path[self.path])))
        await super().handle(scope, receive, send)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        """As :class:`APIRoute`, except that a path some route spells out (``/v1/plans/resolve``) is never a path
        parameter's value (``/v1/plans/{graph_key}``): ``GET /v1/plans/resolve`` is 405, not a malformed key."""
        match, child = super().matches(scope)
        if match is Match.FULL and self.param_convertors and scope.get("path") in CheckedRoute.literal_paths:
            return Match.NONE, {}
        return match, child

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body_params = self.dependant.body_params
        # FastAPI validates a lone body parameter against the whole body: that is what is done here, in a thread
        body_field = body_params[0] if len(body_params) == 1 and not self._embed_body_fields else None
        has_body = bool(body_params)
        role = _required_role(self.dependant)
        raw = any((method, self.path_format) in RAW_UPLOAD_ROUTES for method in self.methods or ())
        record = any((method, self.path_format) in RECORD_ROUTES for method in self.methods or ())
        charged = next((CHARGED_ROUTES[(m, self.path_format)] for m in self.methods or ()
                        if (m, self.path_format) in CHARGED_ROUTES), None)

        async def checked(request: Request) -> Response:
            if b"%00" in request.scope.get("query_string", b""):
                raise InvalidValue("the query string may not contain NUL (%00)")
            req = CheckedRequest(request.scope, request.receive)
            if not has_body and not raw:
                return await handler(req)
            settings = request.app.state.settings
            req.started = time.monotonic()
            if raw:
                req.body_limit = settings.max_blob_bytes
                req.limit_reason = "PLANCACHE_MAX_BLOB_BYTES"
                if isinstance((await get_store(req)).blob_store, DatabaseBlobs):
                    req.memory_factor = DATABASE_UPLOAD_FACTOR
            elif record:
                req.body_limit = record_body_limit(settings)
                req.limit_reason = (f"PLANCACHE_MAX_JSON_BYTES plus {MAX_RECORD_BYTES + MAX_CANDIDATES_BYTES} for the "
                                    "record and its candidates table: a plan upload carries its record alone, the blob "
                                    "goes raw to PUT /v1/blobs/{sha256} before")
                req.memory_factor = JSON_MEMORY_FACTOR
            else:
                req.body_limit = min(settings.max_json_bytes, settings.max_request_bytes)
                req.limit_reason = "PLANCACHE_MAX_JSON_BYTES: the limit of every body but a plan upload's"
                req.memory_factor = JSON_MEMORY_FACTOR
            try:
                if raw:  # the handler's dependencies check the token; it checks the job, then streams the body
                    return await handler(req)
                if role is not None:
                    store = await get_store(req)
                    principal = await authorize_off_loop(req, store, settings, role[0], open_reads_apply=role[1])
                    if charged is not None:
                        _charge(req, principal, charged)
                body = await req.body()
                content_type = req.headers.get("content-type")
                if body and not _is_json(content_type):
                    raise UnsupportedMediaType("the body must be JSON sent with Content-Type: application/json "
                                               f"(this request says {content_type or 'no Content-Type'})")
                if len(body) > INLINE_PARSE_BYTES:
                    req._json = await run_parser(request.app, _parse_and_validate, body, body_field)
                elif body:
                    req._json = _parse_and_validate(body, body_field)
                return await handler(req)
            finally:
                req.release()

        return checked


#: What the JSON schema of every string says about NUL, which the server refuses in bodies and query strings.
NO_NUL_PATTERN = "^[^\\u0000]*$"
_STRING_RULES = {"pattern", "enum", "const", "format"}


#: The schema of a JSON value the server takes where a model takes any (a spec document): what
#: :func:`strict_json_loads` accepts, no NUL in a string or key and no integer of more than :data:`MAX_INT_CHARS`
#: characters.
JSON_VALUE_REF = "#/components/schemas/JsonValue"
JSON_VALUE = {"anyOf": [
    {"type": "string", "pattern": NO_NUL_PATTERN},
    {"type": "integer", "minimum": -int("9" * (MAX_INT_CHARS - 1)), "maximum": int("9" * MAX_INT_CHARS)},
    {"type": "number", "not": {"type": "integer"}},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "array", "items": {"$ref": JSON_VALUE_REF}},
    {"type": "object", "propertyNames": {"pattern": NO_NUL_PATTERN}, "additionalProperties": {"$ref": JSON_VALUE_REF}},
], "description": "any JSON value without NUL characters or integers of more than 20 characters"}


def _state_no_nul(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") == "string" and not _STRING_RULES & node.keys():
            node["pattern"] = NO_NUL_PATTERN
        if node.get("type") == "object" and node.get("additionalProperties") is True:  # values of any JSON type
            node["additionalProperties"] = {"$ref": JSON_VALUE_REF}
        if node.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
            node.setdefault("propertyNames", {}).setdefault("pattern", NO_NUL_PATTERN)
        for value in node.values():
            _state_no_nul(value)
    elif isinstance(node, list):
        for value in node:
            _state_no_nul(value)


#: pydantic's names of bounds it could not place (a constrained ``int | None``) → JSON Schema's.
_BOUND_NAMES = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(node: Any) -> None:
    """Bounds in JSON Schema's words, and whole numbers for an integer's: FastAPI's OpenAPI model holds every
    bound as a float (INT64_MAX becomes 2**63, which the server refuses), so a bound is recomputed from the
    int64 range the server checks (an integer of more than 20 characters or outside int64 is never taken)."""
    if isinstance(node, dict):
        for short, name in _BOUND_NAMES.items():
            if short in node:
                node[name] = node.pop(short)
        if node.get("type") == "integer":
            for name in ("minimum", "maximum"):
                bound = node.get(name)
                if isinstance(bound, float) and bound.is_integer():
                    node[name] = min(max(int(bound), -INT64_MAX), INT64_MAX) if abs(bound) >= 2**63 else int(bound)
        for value in node.values():
            _standard_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _standard_bounds(value)


def _server_rules(settings: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """(schema, property) → what the server checks there beyond the model: limits that are settings (413 past
    them)."""
    blob = {"blob_size": {"maximum": settings.max_blob_bytes}}
    keys = {"graph_keys": {"maxItems": settings.max_resolve_keys}}
    return {(model, name): rule for models, rules in ((("PlanUpload",), blob),
                                                      (("ResolveRequest", "ExplainRequest"), keys))
            for model in models for name, rule in rules.items()}


#: Schema → what its model's or its route's own checks require of a whole body (422 otherwise): a tune request
#: names keys or specs (the admin route).
WHOLE_BODY_RULES: dict[str, dict[str, Any]] = {
    "TuneRequest": {"anyOf": [{"required": ["graph_keys"], "properties": {"graph_keys": {"minItems": 1}}},
                              {"required": ["specs"], "properties": {"specs": {"minItems": 1}}}]},
}


def _state_server_rules(schema: dict[str, Any], settings: Any) -> None:
    rules = _server_rules(settings)
    for name, component in schema.get("components", {}).get("schemas", {}).items():
        component.update(WHOLE_BODY_RULES.get(name.split("-")[0], {}))
        for prop, prop_schema in component.get("properties", {}).items():
            rule = rules.get((name.split("-")[0], prop))
            if rule:
                prop_schema.update(rule)


def install_openapi_rules(app: FastAPI) -> None:
    """Make the app's OpenAPI document state what this module and the routes enforce beyond the models: no NUL
    in any string (every string schema without a pattern of its own gets :data:`NO_NUL_PATTERN`, every map's
    keys too, a map of any values takes :data:`JSON_VALUE`), bounds as JSON Schema names them
    (:func:`_standard_bounds`), the limits of the app's settings (:func:`_server_rules`),
    and :data:`WHOLE_BODY_RULES`."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            _standard_bounds(schema)
            _state_server_rules(schema, app.state.settings)
            _state_no_nul(schema)
            schema.setdefault("components", {}).setdefault("schemas", {})["JsonValue"] = JSON_VALUE
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its OpenAPI document

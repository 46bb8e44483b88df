"""Request bodies and URLs, checked before any parsing: a size limit (declared and streamed) and strict JSON.

Strict JSON refuses what Python's ``json`` accepts but the store cannot keep or the wire models
cannot round-trip: ``NaN``/``Infinity`` and overflowing floats, integers of more than 4300 digits,
NUL characters in strings (PostgreSQL text cannot hold them), bytes that are not UTF-8 and nesting
too deep to parse; a NUL in the query string is refused too. Each is a 422, like any invalid JSON. All routes of the app use :class:`CheckedRoute`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

_ESCAPED_NUL = b"\\u0000"
# A \u0000 escape preceded by an even number of backslashes (an odd number escapes the backslash itself).
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def _refuse(message: str) -> json.JSONDecodeError:
    return json.JSONDecodeError(message, "", 0)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _refuse(f"number {text[:40]} is out of range")
    return value


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _refuse(f"integer of {len(text)} digits is too long") from None


def _parse_constant(name: str) -> Any:
    raise _refuse(f"{name} is not valid JSON")


def strict_json_loads(body: bytes) -> Any:
    """``json.loads`` refusing non-finite numbers, huge integers and NUL characters (``json.JSONDecodeError``)."""
    if _ESCAPED_NUL in body and _NUL_ESCAPE.search(body):
        raise _refuse("strings may not contain NUL characters (\\u0000)")
    try:
        return json.loads(body, parse_float=_parse_float, parse_int=_parse_int, parse_constant=_parse_constant)
    except UnicodeDecodeError:
        raise _refuse("the body is not UTF-8 text") from None
    except RecursionError:
        raise _refuse("the body nests too deeply") from None


class CheckedRequest(Request):
    """A request whose body is read at most ``Settings.max_request_bytes`` and parsed as strict JSON."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit = self.app.state.settings.max_request_bytes
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise _too_large(int(declared), limit)
            chunks: list[bytes] = []
            total = 0
            async for chunk in self.stream():
                total += len(chunk)
                if total > limit:
                    raise _too_large(total, limit)
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_json_loads(await self.body())
        return self._json


def _too_large(size: int, limit: int) -> HTTPException:
    # FastAPI passes HTTPException from body reading through unchanged (other exceptions become 400).
    return HTTPException(413, f"request body of {size} bytes or more exceeds the limit of {limit} bytes")


class CheckedRoute(APIRoute):
    """An :class:`APIRoute` whose handler sees a :class:`CheckedRequest` and refuses NUL in the query string."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if b"%00" in request.scope.get("query_string", b""):
                raise HTTPException(422, "the query string may not contain NUL (%00)")
            return await handler(CheckedRequest(request.scope, request.receive))

        return checked

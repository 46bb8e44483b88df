"""What the pydantic models share: the strict base model, the integer bounds and types, and the one way to
say what a validation error found."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

#: The largest value of a signed 32-bit (an ``INTEGER`` column) and 64-bit (``BIGINT``) integer.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class StrictModel(BaseModel):
    """The base of every model that reads input: a field it does not declare is an error (an answer from a server
    is read with :func:`from_answer` instead, which ignores such fields)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)  # a schema is built when first used: importing the
    # wire protocol costs a client process nothing for the models only the server and the worker use


M = TypeVar("M", bound=BaseModel)


def from_answer(model: type[M], content: bytes | str) -> M:
    """``model`` read from a server's JSON answer (or a record a client cache holds), ignoring fields this release
    does not declare, at any depth: a server of a later minor API version (``plancache.http.API_VERSION``) may add
    them. Requests stay strict: the server reads them with :class:`StrictModel`'s ``extra="forbid"``."""
    return model.model_validate_json(content, extra="ignore")


def refuse_bool(value: Any) -> Any:
    """Before an integer field is validated: pydantic's lax mode would read ``true``/``false`` as 1/0."""
    if isinstance(value, bool):
        raise ValueError("Input should be an integer, not a boolean")
    return value


#: An integer field of the wire models: lax (``"5"`` from a query string is 5) but never a boolean.
Int = Annotated[int, BeforeValidator(refuse_bool)]
#: :data:`Int` within a signed 32-bit / 64-bit integer.
Int32 = Annotated[int, Ge(-INT32_MAX - 1), Le(INT32_MAX), BeforeValidator(refuse_bool)]
Int64 = Annotated[int, Ge(-INT64_MAX - 1), Le(INT64_MAX), BeforeValidator(refuse_bool)]

#: The longest time a record may state: a day, in milliseconds (a candidate or tuning run past it is not a
#: measurement plancache makes) and in seconds.
MAX_MS = 86_400_000.0
MAX_SECONDS = 86_400.0
#: A time of a record: finite, not negative, at most a day.
Millis = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
#: A normalised numerics error: finite, not negative, at most MAX_ERROR.
MAX_ERROR = 1e30
Error = Annotated[float, Field(ge=0, le=MAX_ERROR, allow_inf_nan=False)]


def nonfinite_as_none(value: Any) -> Any:
    """Before an optional figure is validated: NaN or infinity (a candidate that never ran, a diverged error)
    is stored as unknown (None); a finite value is then bounded as usual."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


#: Optional figures of a tuning candidate: unknown when not finite, else bounded.
MaybeMillis = Annotated[Millis | None, BeforeValidator(nonfinite_as_none)]
MaybeError = Annotated[Error | None, BeforeValidator(nonfinite_as_none)]

_MAX_PART_CHARS = 300


def validation_message(problems: Sequence[Mapping[str, Any]], limit: int | None = 5) -> str:
    """``loc: msg`` for the first ``limit`` problems (all when None) of a pydantic ``ValidationError.errors()`` or
    FastAPI's ``RequestValidationError.errors()``, e.g. ``body.graph_keys: Field required``; ``; ``-separated,
    each cut at 300 characters, then how many more there were ("" for none)."""
    parts = []
    for problem in problems[:limit]:
        loc = ".".join(str(p) for p in problem.get("loc", ()))
        msg = str(problem.get("msg", "invalid value"))
        if problem.get("type") == "json_invalid":  # loc is ("body", character position)
            loc, msg = "body", f"invalid JSON: {(problem.get('ctx') or {}).get('error', msg)}"
        part = f"{loc}: {msg}" if loc else msg
        parts.append(part if len(part) <= _MAX_PART_CHARS else part[:_MAX_PART_CHARS] + "…")
    if limit is not None and len(problems) > limit:
        parts.append(f"and {len(problems) - limit} more problem(s)")
    return "; ".join(parts)

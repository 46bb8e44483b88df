"""Bearer-token roles: ``reader`` < ``worker`` < ``admin`` (a higher role may do everything a lower one may).

A token is ``PLANCACHE_ADMIN_TOKEN`` (compared in constant time) or one created with
``plancache token create`` (looked up by its hash in the store). No or a malformed
``Authorization`` header, or an unknown or revoked token → 401; a role too low → 403.
With ``Settings.open_reads`` reader routes need no token (a token that is sent must still be valid).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPBearer
from starlette.concurrency import run_in_threadpool

from ..errors import Forbidden, Unauthorized
from ..protocol import Role
from .deps import SettingsDep, StoreDep
from .memo import TtlMemory

ROLE_RANK: dict[Role, int] = {"reader": 0, "worker": 1, "admin": 2}

# Declares the scheme in OpenAPI (the "Authorize" button at /docs); the header is parsed below.
_bearer = HTTPBearer(auto_error=False, scheme_name="token",
                     description="`PLANCACHE_ADMIN_TOKEN`, or a token from `plancache token create --role reader|worker|admin`")


BOOTSTRAP_ADMIN = "bootstrap-admin"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's role and name (``role`` None: anonymous, allowed by open reads), and
    ``identity``, what a job lease is bound to: ``token:<id>`` for a stored token (ids are never reused,
    unlike the names of revoked tokens), ``bootstrap-admin`` for ``PLANCACHE_ADMIN_TOKEN``, None when anonymous."""

    role: Role | None
    name: str
    identity: str | None = None

    def may(self, role: Role) -> bool:
        return self.role is not None and ROLE_RANK[self.role] >= ROLE_RANK[role]


ANONYMOUS = Principal(role=None, name="anonymous")


def _bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
    return token


def _remembered(request: Request, token: str) -> tuple[TtlMemory[Principal] | None, str, Principal | None]:
    """The app's memory of recently authenticated tokens (:mod:`plancache.server.memo`), the token's key in it,
    and the principal remembered for it."""
    memory: TtlMemory[Principal] | None = getattr(request.app.state, "principals", None)
    key = hashlib.sha256(token.encode()).hexdigest()
    return memory, key, memory.get(key) if memory is not None else None


def identify(request: Request, store: Any, admin_token: str | None) -> Principal | None:
    """The principal of the request's bearer token, None without one; :class:`Unauthorized` if it is not valid.
    A stored token authenticated in the last ``token_cache_seconds`` is not looked up again."""
    token = _bearer_token(request)
    return None if token is None else identify_token(request, store, admin_token, token)


def identify_token(request: Request, store: Any, admin_token: str | None, token: str) -> Principal:
    """The principal of ``token`` (from a bearer header, or the status page's session cookie); :class:`Unauthorized`
    if it is not valid."""
    if admin_token and hmac.compare_digest(token.encode(), admin_token.encode()):
        return Principal(role="admin", name=BOOTSTRAP_ADMIN, identity=BOOTSTRAP_ADMIN)
    memory, key, principal = _remembered(request, token)
    if principal is not None:
        return principal
    info = store.authenticate(token)
    if info is None:
        raise Unauthorized("unknown or revoked token")
    principal = Principal(role=info.role, name=info.name, identity=f"token:{info.id}")
    if memory is not None:
        memory.put(key, principal)
    return principal


def _needs_lookup(request: Request) -> bool:
    """Whether identifying the caller means a database lookup (a stored token not remembered)."""
    if PRINCIPAL_SCOPE_KEY in request.scope:
        return False
    try:
        token = _bearer_token(request)
    except Unauthorized:
        return False  # refused without a lookup
    return token is not None and _remembered(request, token)[2] is None


def _a(role: Role) -> str:
    return f"an {role}" if role == "admin" else f"a {role}"


def require(role: Role, *, open_reads_apply: bool = True) -> Callable[..., Awaitable[Principal]]:
    """A dependency admitting callers whose token has ``role`` or a higher one (reader routes admit anonymous
    callers under ``open_reads`` unless ``open_reads_apply`` is off)."""

    async def dependency(request: Request, store: StoreDep, settings: SettingsDep, _: Any = Depends(_bearer)) -> Principal:
        return await authorize_off_loop(request, store, settings, role, open_reads_apply=open_reads_apply)

    dependency.plancache_role = (role, open_reads_apply)  # type: ignore[attr-defined]  # read by bodies.CheckedRoute
    return dependency


#: Where :func:`authorize` keeps a request's principal (its scope), so that checking twice looks the token up once.
PRINCIPAL_SCOPE_KEY = "plancache.principal"


def authorize(request: Request, store: Any, settings: Any, role: Role, *, open_reads_apply: bool = True) -> Principal:
    """What :func:`require`'s dependency checks. :class:`~plancache.server.bodies.CheckedRoute` calls it before
    a request body is read (a caller without the role never gets a body parsed), the dependency again after."""
    principal: Principal | None
    if PRINCIPAL_SCOPE_KEY in request.scope:
        principal = request.scope[PRINCIPAL_SCOPE_KEY]
    else:
        principal = request.scope[PRINCIPAL_SCOPE_KEY] = identify(request, store, settings.admin_token)
    if principal is None:
        if role == "reader" and settings.open_reads and open_reads_apply:
            return ANONYMOUS
        raise Unauthorized(f"this route needs {_a(role)} token: send 'Authorization: Bearer <token>'")
    if not principal.may(role):
        raise Forbidden(f"token {principal.name!r} has role {principal.role}; this route needs {role}")
    return principal


async def authorize_off_loop(request: Request, store: Any, settings: Any, role: Role, *,
                             open_reads_apply: bool = True) -> Principal:
    """:func:`authorize`, in a worker thread when it looks the token up in the database, else on the event loop
    (a token checked before, or none: handing a check of microseconds to a thread costs more than the check)."""
    if _needs_lookup(request):
        return await run_in_threadpool(authorize, request, store, settings, role, open_reads_apply=open_reads_apply)
    return authorize(request, store, settings, role, open_reads_apply=open_reads_apply)


Reader = Annotated[Principal, Depends(require("reader"))]
#: Any token holder (clients report the specs they miss); never anonymous, even with open reads.
TokenReader = Annotated[Principal, Depends(require("reader", open_reads_apply=False))]
Worker = Annotated[Principal, Depends(require("worker"))]
Admin = Annotated[Principal, Depends(require("admin"))]

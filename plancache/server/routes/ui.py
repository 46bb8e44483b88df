"""The status page for people: ``GET /ui`` (a bearer token, the page's session cookie, or open reads), and the
sign-in form that sets that cookie (``POST /ui/login``, ``POST /ui/logout``).

The session cookie holds a reader token (only a reader token is taken: a stolen cookie reads, nothing more); it is
``HttpOnly``, ``SameSite=Strict``, ``Secure`` when the page is reached over https, scoped to ``/ui`` and honoured
by ``GET /ui`` alone, so no other route can be driven by it. Sign-in and sign-out refuse a form posted from another
site's page (its ``Origin`` differs), and the page's CSP lets forms post to this site only.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ...errors import Forbidden, InvalidValue, PayloadTooLarge, Unauthorized, UnsupportedMediaType
from ...settings import ServerSettings
from ..auth import ANONYMOUS, Principal, authorize, identify_token
from ..autotune import autotune_policy
from ..bodies import CheckedRoute
from ..deps import SettingsDep, StoreDep
from ..errors import documented_errors
from ..status_page import gather, render, render_login

router = APIRouter(route_class=CheckedRoute, tags=["status"])

#: The session cookie's name, lifetime, and the longest token and sign-in form it takes.
COOKIE = "plancache_session"
SESSION_SECONDS = 8 * 3600
MAX_TOKEN_CHARS = 512
MAX_FORM_BYTES = 4096

_HEADERS = {"Cache-Control": "no-store", "X-Frame-Options": "DENY",
            "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; "
                                       "form-action 'self'; frame-ancestors 'none'"}


def _json_errors(*statuses: int) -> dict[int | str, dict[str, object]]:
    """Documented errors of an HTML route: JSON, whatever the page's own type."""
    return {s: {**e, "content": {"application/json": {}}} for s, e in documented_errors(*statuses).items()}


#: GET /ui's 401: the sign-in form for a browser (``Accept: text/html``), the JSON error for other clients.
_UI_401 = {**documented_errors(401)[401], "description": "the sign-in form for a browser (Accept: text/html); "
                                                        "the JSON error for other clients",
           "content": {"text/html": {}, "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _cookie_token(request: Request) -> str | None:
    token = request.cookies.get(COOKIE)
    return token if token and len(token) <= MAX_TOKEN_CHARS and token.isascii() and token.isprintable() else None


def _viewer(request: Request, store: Any, settings: ServerSettings) -> Principal | None:
    """Who may see the page: a bearer token's holder (refused as on every route when it is not valid), a session
    cookie's reader, or anyone under open reads; None: ask for a sign-in."""
    if "authorization" in request.headers:
        return authorize(request, store, settings, "reader")
    token = _cookie_token(request)
    if token is not None:
        try:
            principal = identify_token(request, store, settings.admin_token, token)
        except Unauthorized:  # revoked since: sign in again
            principal = None
        if principal is not None and principal.role == "reader":
            return principal
    return ANONYMOUS if settings.open_reads else None


def _wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def _login_page(request: Request, status: int, problem: str | None = None) -> HTMLResponse:
    page = HTMLResponse(render_login(problem), status_code=status, headers={**_HEADERS, "WWW-Authenticate": "Bearer"})
    if COOKIE in request.cookies:
        page.delete_cookie(COOKIE, path="/ui")
    return page


@router.get("/ui", summary="The status page (HTML)", response_class=HTMLResponse,
            responses={200: {"content": {"text/html": {}}, "description": "one HTML page, no script"},
                       # errors stay JSON, whatever the page's own type, but the browser's sign-in form
                       **_json_errors(403, 503),
                       401: _UI_401})
async def status_page(request: Request, store: StoreDep, settings: SettingsDep) -> Response:
    """Plan coverage per environment, the workers and what no worker can take, failed jobs first, the most missed
    graphs and why each has no plan, and per plan the tuned time against the heuristic's. Server-rendered, without
    script or external resources. Reader role: a bearer token, or the session cookie `POST /ui/login` sets (a
    browser without either is shown the sign-in form), or open reads."""
    viewer = await run_in_threadpool(_viewer, request, store, settings)
    if viewer is None:
        if _wants_html(request):
            return _login_page(request, 401)
        raise Unauthorized("this page needs a reader token: send 'Authorization: Bearer <token>', or sign in with "
                           "a browser")
    status = await run_in_threadpool(gather, store, autotune_policy(request))
    signed_in = viewer.name if viewer.role is not None and "authorization" not in request.headers else None
    return HTMLResponse(render(status, signed_in=signed_in), headers=_HEADERS)


def _same_origin(request: Request) -> bool:
    """Whether the form was posted from this site's page (a browser sends ``Origin`` with every POST)."""
    origin = request.headers.get("origin")
    if origin is None:
        return True  # not a browser's cross-site form: nothing to fear from it
    return urlsplit(origin).netloc.lower() == request.headers.get("host", "").lower()


async def _form(request: Request) -> dict[str, list[str]]:
    """The posted form's fields: ``application/x-www-form-urlencoded``, at most ``MAX_FORM_BYTES``."""
    if not _same_origin(request):
        raise Forbidden("a form posted from another site's page is refused")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise UnsupportedMediaType("send the form as application/x-www-form-urlencoded")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise PayloadTooLarge(f"the form is {declared} bytes; at most {MAX_FORM_BYTES}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise PayloadTooLarge(f"the form is over {MAX_FORM_BYTES} bytes")
    try:
        return parse_qs(body.decode("latin-1"), max_num_fields=8)
    except ValueError:  # over max_num_fields
        raise InvalidValue("the sign-in form has one field, token") from None


_FORM_BODY = {"requestBody": {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": {
    "type": "object", "required": ["token"],
    "properties": {"token": {"type": "string", "maxLength": MAX_TOKEN_CHARS, "description": "a reader token"}}}}}}}


@router.post("/ui/login", summary="Sign in to the status page with a reader token (an HTML form)",
             response_class=HTMLResponse, status_code=303, openapi_extra=_FORM_BODY,
             responses={303: {"description": "signed in: the session cookie is set, and the page is /ui"},
                        401: {"content": {"text/html": {}}, "description": "the form again, saying why"},
                        **_json_errors(403, 413, 415, 422, 503)})
async def login(request: Request, store: StoreDep, settings: SettingsDep) -> Response:
    """Take a reader token from the sign-in form and keep it in the page's session cookie (HttpOnly, SameSite=Strict,
    Secure over https, path /ui, 8 hours). A worker or admin token is refused: make a reader token for people."""
    token = (_form_token(await _form(request)) or "").strip()
    if not token or len(token) > MAX_TOKEN_CHARS or not (token.isascii() and token.isprintable()):
        return _login_page(request, 401, "that is not a token: paste the whole token `plancache token create` printed")
    try:
        principal = await run_in_threadpool(identify_token, request, store, settings.admin_token, token)
    except Unauthorized:
        return _login_page(request, 401, "unknown or revoked token")
    if principal.role != "reader":
        return _login_page(request, 401, f"a {principal.role} token is refused here: sign in with a reader token "
                                         "(plancache token create --role reader --name NAME)")
    page = RedirectResponse("/ui", status_code=303, headers={"Cache-Control": "no-store"})
    secure = request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"
    page.set_cookie(COOKIE, token, max_age=SESSION_SECONDS, path="/ui", httponly=True, samesite="strict", secure=secure)
    return page


def _form_token(fields: dict[str, list[str]]) -> str | None:
    values = fields.get("token") or []
    return values[0] if len(values) == 1 else None


@router.post("/ui/logout", summary="Sign out of the status page", response_class=HTMLResponse,
             responses={200: {"content": {"text/html": {}}, "description": "the sign-in form; the cookie is cleared"},
                        **_json_errors(403)})
async def logout(request: Request) -> Response:
    """Clear the page's session cookie and show the sign-in form."""
    if not _same_origin(request):
        raise Forbidden("a form posted from another site's page is refused")
    page = HTMLResponse(render_login(note="signed out"), headers=_HEADERS)
    page.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return page

"""The one HTTP layer to a plancache server: URL check, httpx set-up, error answers, retry and breaker policies.

A call is one *attempt* (send, read the answer) wrapped in the client's policies, outermost first. An attempt:

- returns the caller's reading of an answer below 400 (a body it cannot read is a malformed answer);
- raises :class:`~plancache.errors.ServerUnavailable` for a transport failure (refused, reset, timed out),
  a 429 or 5xx answer, or a malformed answer; a request that fails unanswered on a connection kept alive from
  an earlier call (reset or closed by the server: :data:`STALE_CONNECTION_ERRORS`) is first sent again, once,
  on a new connection, within the same attempt (so neither policy sees it);
- raises, for any other 4xx, the error class of the code in its ``{"error": {"code", "message"}}`` body
  (:data:`~plancache.errors.BY_CODE`, e.g. ``409 lease_lost`` → LeaseLost), else
  :class:`~plancache.errors.RequestRefused` with the answer's code and status.

Policies: :class:`Retry` sends a call again after ServerUnavailable, with backoff; :class:`CircuitBreaker`
fails every call at once for a cool-down after one failure. Needs only the base install (httpx, pydantic).

Answers are streamed, so a call may bound them while they arrive: ``max_bytes`` (an answer declaring more is
refused before its body is read; one delivering more is cut off at the network chunk that crosses the limit, so
at most ``max_bytes`` plus one chunk is ever held) and ``deadline`` (a :func:`time.monotonic` instant by which
the whole answer must be in, connect and headers included: the exchange runs on a helper thread and the caller
gets ServerUnavailable at that instant at the latest). Either failure is ServerUnavailable, so a
:class:`CircuitBreaker` opens as for any other. Calls without them read the whole answer, as before.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from . import __version__
from ._httpx import httpx
from .errors import BY_CODE, PlanCacheError, RequestRefused, ServerSpeaksHttp, ServerUnavailable
from .settings import ConnectionSettings
from .validation import from_answer, validation_message

log = logging.getLogger("plancache.http")

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

MAX_MESSAGE_CHARS = 500
#: Refusals that say the server cannot help this client now (its token), not that one request was wrong.
AUTH_STATUSES = frozenset({401, 403})


#: The wire's revision within ``/v1`` (``MAJOR.MINOR``): a minor step only adds (a field in an answer, a route, an
#: optional field in a request), so a caller of any earlier minor works against it unchanged; a major step is a
#: new path prefix. Every answer names it in :data:`API_VERSION_HEADER`, and ``/healthz`` in its body.
API_VERSION = "1.4"
API_VERSION_HEADER = "X-Plancache-Api-Version"
#: What calls a server: a client library, a worker, the command line. Each sends ``User-Agent:
#: plancache-<agent>/<release>`` (:func:`user_agent`); the server counts calls per agent and release.
Agent = Literal["client", "worker", "cli"]
#: A ``User-Agent`` that :func:`user_agent` makes: group 1 the agent, group 2 the release (a PEP 440 version).
USER_AGENT_PATTERN = r"^plancache-(client|worker|cli)/([0-9][0-9A-Za-z.+!-]{0,31})(?:[ ;(]|$)"


def user_agent(agent: Agent) -> str:
    """The ``User-Agent`` of ``agent`` at this release."""
    return f"plancache-{agent}/{__version__}"


def check_url(server_url: str) -> str:
    """``server_url`` without its trailing slash; ValueError unless it is an http(s) URL."""
    if not server_url.startswith(("http://", "https://")):
        raise ValueError(f"server URL {server_url!r} must start with http:// or https://")
    try:
        url = httpx.URL(server_url)
    except httpx.InvalidURL as exc:  # e.g. http://[::1
        raise ValueError(f"server URL {server_url!r} is not a URL: {exc}") from None
    if not url.host:  # e.g. http://$HOST:8787 with HOST unset
        raise ValueError(f"server URL {server_url!r} has no host")
    if url.port is not None and not 0 < url.port < 65536:
        raise ValueError(f"server URL {server_url!r}: port {url.port} is out of range")
    return server_url.rstrip("/")


def tls_verification(server_url: str) -> ssl.SSLContext | bool:
    """httpx's ``verify`` for ``server_url``: certificate verification with the CA bundle for https; for plain
    http, where no TLS is spoken, a context that trusts no certificate at all, so no bundle is loaded (20-250 ms of
    a client's start) and a TLS connection could not succeed anyway (redirects are not followed)."""
    if server_url.startswith("https://"):
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, hostname checked, no CA: fails closed


def error_body(resp: httpx.Response) -> tuple[str, str]:
    """``(code, message)`` of an error answer: its ``{"error": {"code", "message"}}`` body (see
    :mod:`plancache.server.errors`), else ``http_<status>`` and the start of its text."""
    try:
        body = resp.json()["error"]
        code, message = str(body["code"]), str(body["message"])
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested past the stack
        code, message = f"http_{resp.status_code}", resp.text or resp.reason_phrase
    return code, message[:MAX_MESSAGE_CHARS]


def error_from_response(resp: httpx.Response) -> PlanCacheError:
    """The error an answer of status 400 or more stands for (see the module docstring)."""
    code, message = error_body(resp)
    text = f"{resp.request.method} {resp.request.url}: {resp.status_code} {code}: {message}"
    if resp.status_code == 429 or resp.status_code >= 500:
        return ServerUnavailable(text, throttled=resp.status_code == 429)
    cls = BY_CODE.get(code)
    if cls is None:
        return RequestRefused(text, code=code, http_status=resp.status_code)
    error = cls(text)
    error.http_status = resp.status_code
    return error


def json_as(model: type[M]) -> Callable[[httpx.Response], M]:
    """A reader for :meth:`HttpClient.read`: the answer's JSON body as ``model``, fields it does not declare ignored
    (:func:`~plancache.validation.from_answer`)."""
    return lambda resp: from_answer(model, resp.content)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: attempt ``n`` waits between half and all of ``min(cap, initial * factor**n)``."""

    initial: float = 0.2
    factor: float = 2.0
    cap: float = 30.0

    def delay(self, attempt: int) -> float:
        ceiling = min(self.cap, self.initial * self.factor ** min(attempt, 64))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass(frozen=True)
class Call:
    """One call as the policies see it: what is sent, its options, and the client's ``stop``."""

    method: str
    url: str
    retry: bool  # Retry may send it again
    # a 401/403 or 429 answer trips a CircuitBreaker; else it concerns this call's route only (its permission, its budget)
    trips_on_refusal: bool
    stop: threading.Event  # set: waiting policies give up (shutting down), and so does a wait for the answer
    # False: a failure of this call does not trip a CircuitBreaker (a background check: what the process needs now
    # must not be held back for a cool-down because of it); an open breaker still holds it back
    trips: bool = True

    def __str__(self) -> str:
        return f"{self.method} {self.url}"


class Policy(Protocol):
    """Wraps every attempt of a call: may run it again, or not at all."""

    def apply(self, call: Call, attempt: Callable[[], T]) -> T: ...


@dataclass(frozen=True)
class Retry:
    """Runs an attempt again after ServerUnavailable (unless the call says ``retry=False``), waiting ``backoff``,
    for up to ``within`` seconds (None: until the client's ``stop`` is set). A wait ends early when ``stop``
    is set; the call then fails with ServerUnavailable."""

    backoff: Backoff = Backoff()
    within: float | None = None

    def apply(self, call: Call, attempt: Callable[[], T]) -> T:
        deadline = None if self.within is None else time.monotonic() + self.within
        tries = 0
        while True:
            try:
                return attempt()
            except ServerUnavailable as exc:
                if exc.skipped or not exc.retryable or not call.retry:
                    raise
                failure = exc
            wait = self.backoff.delay(tries)
            tries += 1
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if wait <= 0 or call.stop.is_set():
                raise ServerUnavailable(f"{failure.message} (after {tries} attempt(s))")
            log.warning("%s; retrying in %.2f s", failure.message, wait)
            if call.stop.wait(wait):
                raise ServerUnavailable(f"{failure.message} (stopping)")


class CircuitBreaker:
    """After one failure (ServerUnavailable, but a 429 to a call that does not ``trips_on_refusal``; or a 401/403
    answer to one that does) every call fails at once with ServerUnavailable(skipped=True), sending nothing, for
    ``cooldown`` seconds. The first call after the cool-down is sent: a success closes the breaker, a failure re-arms
    it."""

    def __init__(self, cooldown: float = 30.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        if cooldown < 0:
            raise ValueError("cooldown must be >= 0")
        self.cooldown = cooldown
        self._clock = clock
        self._lock = threading.Lock()
        self._off_until: float | None = None
        self._last_failure = ""

    @property
    def is_off(self) -> bool:
        """True while the breaker is open (the cool-down after a failure has not passed)."""
        with self._lock:
            return self._off_until is not None and self._clock() < self._off_until

    def apply(self, call: Call, attempt: Callable[[], T]) -> T:
        with self._lock:
            left = 0.0 if self._off_until is None else self._off_until - self._clock()
            if left > 0:
                raise ServerUnavailable(f"{call}: not sent, the server is off for another {left:.1f} s after: "
                                        f"{self._last_failure}", skipped=True)
        try:
            result = attempt()
        except ServerUnavailable as exc:
            if exc.skipped or not call.trips:  # nothing was sent (its deadline had passed), or a background call
                raise
            if exc.throttled and not call.trips_on_refusal:  # over that route's budget (spec writes): not the server's state
                raise
            raise self._trip(exc.message) from None
        except PlanCacheError as exc:
            if call.trips and call.trips_on_refusal and exc.http_status in AUTH_STATUSES:
                raise self._trip(exc.message) from None
            raise
        with self._lock:
            self._off_until = None
        return result

    def _trip(self, problem: str) -> ServerUnavailable:
        with self._lock:
            self._off_until = self._clock() + self.cooldown
            self._last_failure = problem
        log.warning("plancache server unusable (%s); not asking it again for %.0f s", problem, self.cooldown)
        return ServerUnavailable(problem)


#: Failures of a request on a connection before any answer came that mean the server had dropped the connection
#: (reset, closed): on a connection kept alive from an earlier call, the request is sent again once, on a new one.
STALE_CONNECTION_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def _plain_http_answer(exc: BaseException) -> bool:
    """Whether ``exc`` came from a TLS handshake answered with something that is not TLS (a plain-HTTP server's
    ``HTTP/1.1 400``: OpenSSL's ``WRONG_VERSION_NUMBER``)."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain httpx -> httpcore -> ssl
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError) and seen.reason == "WRONG_VERSION_NUMBER":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class ConnectionUse:
    """httpcore's ``trace`` request extension, noting whether the request went out on a connection kept alive
    from an earlier request (its head was sent and no connection was opened for it)."""

    def __init__(self) -> None:
        self.opened = self.sent = False

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event.startswith(("connection.connect_tcp.", "connection.connect_unix_socket.")):
            self.opened = True
        elif event.startswith("http11.send_request_headers."):
            self.sent = True

    @property
    def reused(self) -> bool:
        return self.sent and not self.opened


def _response(resp: httpx.Response) -> httpx.Response:
    return resp


#: Headers that describe the body as it came over the wire, not the whole, decoded body handed to a reader.
_WIRE_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})
#: Sent with every request to a plancache server: the server never compresses, so a size cap counts what is sent.
IDENTITY = {"Accept-Encoding": "identity"}
#: How often a wait for an answer looks at the client's ``stop``, in seconds.
_STOP_POLL = 0.05
#: The request header naming the client process a request comes from (:func:`process_id`, sent on every request of
#: a :class:`Http` client): the server counts a key's misses per caller and process.
PROCESS_HEADER = "X-Plancache-Process"
_PROCESS_NONCE = secrets.token_hex(8)


def process_id() -> str:
    """This process's id in :data:`~plancache.protocol.PROCESS_HEADER`: random, with the pid (a forked child is
    another process)."""
    return f"{_PROCESS_NONCE}-{os.getpid()}"


def refuse_encoded(resp: httpx.Response, what: object) -> None:
    """ServerUnavailable (naming ``what``, the call) when the answer's body is content-encoded although
    :data:`IDENTITY` was asked for: decoding could turn a few KiB into gigabytes at once, before any size cap."""
    encoding = resp.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ServerUnavailable(f"{what}: the answer is {encoding[:40]}-encoded; identity was asked for")


def _first_problem(exc: ValueError) -> str:
    return validation_message(exc.errors(), 1) if isinstance(exc, ValidationError) else str(exc)


class HttpClient:
    """A plancache server over HTTP: bearer ``token``, connect/read timeouts (default: the settings'
    ``PLANCACHE_CONNECT_TIMEOUT`` / ``PLANCACHE_READ_TIMEOUT``), the error mapping of the module docstring,
    and ``policies`` (outermost first) around every attempt. Set ``stop`` to make waiting policies give up.
    Every request names ``agent`` and this release in its ``User-Agent``. Thread-safe.

    ``server_url`` may name several servers, comma-separated (replicas, or sites holding the same plans): an
    attempt goes to the one that last answered (the first at the start), and on ServerUnavailable there (unreachable,
    429 or 5xx, a malformed answer) to the next in turn, within the call's deadline; any other answer is final. The
    attempt fails only when every server failed, so a policy sees the fleet, not one server."""

    def __init__(self, server_url: str, token: str | None = None, *, agent: Agent = "client",
                 policies: Sequence[Policy] = (),
                 connect_timeout: float | None = None, read_timeout: float | None = None,
                 stop: threading.Event | None = None, transport: httpx.BaseTransport | None = None) -> None:
        #: Every server, in the order given; :attr:`server_url` is the first.
        self.server_urls = tuple(check_url(url.strip()) for url in server_url.split(","))
        self.server_url = self.server_urls[0]
        if connect_timeout is None or read_timeout is None:
            settings = ConnectionSettings()
            connect_timeout = settings.connect_timeout if connect_timeout is None else connect_timeout
            read_timeout = settings.read_timeout if read_timeout is None else read_timeout
        if not (0 < connect_timeout < math.inf and 0 < read_timeout < math.inf):  # NaN too
            raise ValueError("connect and read timeouts must be finite and > 0")
        self.policies = tuple(policies)
        self.stop = stop or threading.Event()
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        headers = {"User-Agent": user_agent(agent), PROCESS_HEADER: process_id()}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._clients = [httpx.Client(base_url=url, headers=headers, transport=transport,
                                      timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
                                      verify=tls_verification(url)) for url in self.server_urls]
        self._preferred = 0  # the index of the server that answered last

    def request(self, method: str, path: str, *, body: Any = None, timeout: float | None = None, retry: bool = True,
                trips_on_refusal: bool = True, max_bytes: int | None = None, deadline: float | None = None,
                content: bytes | None = None, headers: dict[str, str] | None = None,
                trips: bool = True) -> httpx.Response:
        """The answer (status below 400) to ``method path`` with JSON ``body``, its body read whole; see :meth:`read`."""
        return self.read(method, path, _response, body=body, timeout=timeout, retry=retry,
                         trips_on_refusal=trips_on_refusal, max_bytes=max_bytes, deadline=deadline, content=content,
                         headers=headers, trips=trips)

    def read(self, method: str, path: str, reader: Callable[[httpx.Response], T], *, body: Any = None,
             timeout: float | None = None, retry: bool = True, trips_on_refusal: bool = True,
             max_bytes: int | None = None, deadline: float | None = None, content: bytes | None = None,
             headers: dict[str, str] | None = None, trips: bool = True) -> T:
        """``reader`` of the answer to ``method path`` with JSON ``body`` (or raw ``content``, as
        ``application/octet-stream``) and extra ``headers``, through the policies. ``timeout``
        replaces the client's timeouts for this call; ``retry``, ``trips_on_refusal`` and ``trips`` are the
        :class:`Call`'s.
        ``max_bytes``: the largest answer body read (more is ServerUnavailable); ``deadline``: the
        :func:`time.monotonic` instant by which each attempt's whole answer must have arrived (else
        ServerUnavailable, at that instant)."""
        call = Call(method, self.server_url + path, retry, trips_on_refusal, self.stop, trips)
        headers = dict(headers or {})
        headers.update(IDENTITY)
        if content is not None:
            headers["Content-Type"] = "application/octet-stream"

        def exchange(http: httpx.Client, call: Call, cancel: threading.Event | None) -> httpx.Response:
            for again in (False, True):
                limits = self._timeouts(timeout, deadline)
                use = ConnectionUse()
                try:
                    request = http.build_request(method, path, json=body, content=content, headers=headers,
                                                 timeout=limits, extensions={"trace": use})
                    resp = http.send(request, stream=True)
                    break
                except STALE_CONNECTION_ERRORS as exc:
                    if again or not use.reused:
                        raise ServerUnavailable(f"{call}: {type(exc).__name__}: {exc}") from None
                    # a kept-alive connection the server had dropped: no answer came; once, on a new connection
                    log.debug("%s: %s on a reused connection; sending it again", call, type(exc).__name__)
                except httpx.RequestError as exc:  # refused, timed out, other protocol errors
                    if call.url.startswith("https://") and _plain_http_answer(exc):
                        plain = "http://" + call.url.removeprefix("https://").split("/", 1)[0]
                        raise ServerSpeaksHttp(f"{call}: the server speaks plain HTTP, not HTTPS (its answer to the "
                                               f"TLS handshake was not TLS): use {plain}") from None
                    raise ServerUnavailable(f"{call}: {type(exc).__name__}: {exc}") from None
                except RuntimeError:
                    if not http.is_closed:
                        raise
                    raise ServerUnavailable(f"{call}: the client was closed during the call") from None
            try:
                return self._whole(call, resp, max_bytes, cancel)
            except httpx.RequestError as exc:  # reset, read timeout, bad encoding while the body arrives
                raise ServerUnavailable(f"{call}: {type(exc).__name__} while reading the answer: {exc}") from None
            finally:
                resp.close()

        def attempt_on(index: int) -> T:
            http = self._clients[index]
            at = call if index == 0 else replace(call, url=self.server_urls[index] + path)
            go = partial(exchange, http, at)
            resp = go(None) if deadline is None else self._by(deadline, at, go)
            if resp.status_code >= 400:
                raise error_from_response(resp)
            try:
                return reader(resp)
            except ValueError as exc:  # invalid JSON, pydantic's ValidationError
                raise ServerUnavailable(f"{at}: malformed answer: {_first_problem(exc)}") from None

        def attempt() -> T:
            first = self._preferred
            for n in range(len(self._clients)):
                index = (first + n) % len(self._clients)
                try:
                    result = attempt_on(index)
                except ServerUnavailable as exc:
                    if exc.skipped or n + 1 == len(self._clients):  # nothing sent (its deadline), or the last one
                        raise
                    log.info("%s; trying %s", exc.message, self.server_urls[(index + 1) % len(self._clients)])
                    continue
                self._preferred = index
                return result
            raise AssertionError("unreachable: the last server's failure is raised")

        run: Callable[[], T] = attempt
        for policy in reversed(self.policies):
            run = partial(policy.apply, call, run)
        return run()

    def _timeouts(self, timeout: float | None, deadline: float | None) -> httpx.Timeout:
        """The call's timeouts, none longer than what is left until ``deadline``."""
        connect, read = (timeout, timeout) if timeout is not None else (self.connect_timeout, self.read_timeout)
        if deadline is not None:
            left = max(deadline - time.monotonic(), 0.001)
            connect, read = min(connect, left), min(read, left)
        return httpx.Timeout(read, connect=connect)

    @staticmethod
    def _whole(call: Call, resp: httpx.Response, max_bytes: int | None,
               cancel: threading.Event | None) -> httpx.Response:
        """``resp`` (streaming) read into a plain response, refusing a body over ``max_bytes``."""
        def too_large(how: str) -> ServerUnavailable:
            return ServerUnavailable(f"{call}: the answer {how} the {max_bytes}-byte limit of this call; not read further")

        refuse_encoded(resp, call)
        if max_bytes is not None:
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise too_large(f"declares {declared} bytes, over")
        body = bytearray()
        for chunk in resp.iter_bytes():
            if cancel is not None and cancel.is_set():
                raise ServerUnavailable(f"{call}: abandoned at its deadline")
            body += chunk
            if max_bytes is not None and len(body) > max_bytes:
                raise too_large("exceeds")
        # a HEAD answer's Content-Length is what a GET would send: kept (there is no body for httpx to count)
        headers = [(k, v) for k, v in resp.headers.multi_items()
                   if k.lower() not in _WIRE_HEADERS or (call.method == "HEAD" and k.lower() == "content-length")]
        return httpx.Response(resp.status_code, headers=headers, content=bytes(body), request=resp.request,
                              extensions={k: v for k, v in resp.extensions.items() if k == "reason_phrase"})

    @staticmethod
    def _by(deadline: float, call: Call, exchange: Callable[[threading.Event | None], httpx.Response]) -> httpx.Response:
        """``exchange`` on a helper thread, waited for until ``deadline`` or the client's ``stop``: the caller is back
        in time whatever the server does (connect, headers or a body dripped byte by byte). A late exchange is told
        to stop at its next chunk; its timeouts are already no longer than the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServerUnavailable(f"{call}: not sent, its deadline has passed", skipped=True)
        done, cancel = threading.Event(), threading.Event()
        outcome: list[httpx.Response | BaseException] = []

        def run() -> None:
            try:
                outcome.append(exchange(cancel))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                outcome.append(exc)
            finally:
                done.set()

        try:
            threading.Thread(target=run, name="plancache-http", daemon=True).start()
        except RuntimeError:  # the interpreter is exiting (no new threads): on this thread, its timeouts within the deadline
            run()
        while not done.wait(min(_STOP_POLL, max(deadline - time.monotonic(), 0))):
            if call.stop.is_set():  # the client is closing: the answer is not waited for (nothing to say of the server)
                cancel.set()
                raise ServerUnavailable(f"{call}: abandoned, the client is closing", skipped=True)
            if time.monotonic() >= deadline:
                cancel.set()
                raise ServerUnavailable(f"{call}: no whole answer by its deadline ({left:.2f} s after it was sent)")
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        for http in self._clients:
            http.close()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

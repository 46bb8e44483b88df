"""The one error tree. Every layer raises these; the server maps them to HTTP statuses in one place
(:mod:`plancache.server.errors`) and :mod:`plancache.http` maps the server's answers back (:data:`BY_CODE`).

Every error takes its message first (default: the first paragraph of its class docstring); any further
field is a keyword argument.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from enum import StrEnum
from types import MappingProxyType


class PlanCacheError(Exception):
    """Base of every plancache error. ``code`` is a stable machine-readable name."""

    code = "plancache_error"
    http_status = 400

    def __init__(self, message: str | None = None) -> None:
        if message is None:
            message = " ".join((type(self).__doc__ or self.code).split("\n\n")[0].split())
        super().__init__(message)
        self.message = message


class SpecError(PlanCacheError):
    """A GraphSpec is malformed: unknown op, dangling tensor, shape or dtype mismatch."""

    code = "invalid_spec"
    http_status = 422


class NotFound(PlanCacheError):
    """Not found."""

    code = "not_found"
    http_status = 404


class Conflict(PlanCacheError):
    """The request contradicts stored state (e.g. a different blob for an existing plan)."""

    code = "conflict"
    http_status = 409


class IntegrityError(PlanCacheError):
    """Bytes do not match their declared digest or size."""

    code = "integrity_error"
    http_status = 422


class StaleRevision(Conflict):
    """A replacement plan's revision is not above the stored plan's: an older record may not replace a newer one."""

    code = "stale_revision"
    http_status = 409


class LeaseLost(PlanCacheError):
    """A job heartbeat/completion came from a holder whose lease was taken over (fenced)."""

    code = "lease_lost"
    http_status = 409


class Unauthorized(PlanCacheError):
    """Missing, malformed, unknown or revoked token."""

    code = "unauthorized"
    http_status = 401


class Forbidden(PlanCacheError):
    """The token's role may not do this."""

    code = "forbidden"
    http_status = 403


class NotLeaseHolder(Forbidden):
    """The job's lease was claimed with another API token: only the token that claimed a job may heartbeat,
    complete or fail it."""

    code = "not_lease_holder"
    http_status = 403


class PayloadTooLarge(PlanCacheError):
    """The request or blob is too large."""

    code = "payload_too_large"
    http_status = 413


class BadRequest(PlanCacheError):
    """The request is malformed."""

    code = "bad_request"
    http_status = 400


class MethodNotAllowed(PlanCacheError):
    """This path does not take that method. ``allowed``: the methods it takes."""

    code = "method_not_allowed"
    http_status = 405

    def __init__(self, message: str | None = None, *, allowed: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.allowed = allowed


class RequestTimeout(PlanCacheError):
    """The request body did not arrive in time."""

    code = "request_timeout"
    http_status = 408


class LengthRequired(PlanCacheError):
    """The request has no Content-Length: send the size of the body."""

    code = "length_required"
    http_status = 411


class UnsupportedMediaType(PlanCacheError):
    """The body is not JSON sent with Content-Type: application/json."""

    code = "unsupported_media_type"
    http_status = 415


class RetryLater(PlanCacheError):
    """Not now: retry after ``retry_after`` seconds (the answer's ``Retry-After``)."""

    code = "retry_later"
    http_status = 503

    def __init__(self, message: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyRequests(RetryLater):
    """This token's budget for the operation is spent."""

    code = "too_many_requests"
    http_status = 429


class ServerBusy(RetryLater):
    """The server holds too many requests in flight."""

    code = "server_busy"
    http_status = 503


class EnvironmentMismatch(PlanCacheError):
    """A plan was built for another GPU environment than the one asking."""

    code = "environment_mismatch"
    http_status = 409


class Reason(StrEnum):
    """Why a record, blob, signature, key or bundle was refused: the ``reason`` of every :class:`VerificationError`,
    and the key the client counts rejects under (``PlanCache.stats().rejects``). Members are their own strings."""

    #: A record, blob, bundle or signed payload that cannot be decoded.
    MALFORMED = "malformed"
    #: The blob's size or sha256 is not its record's.
    SIZE = "size"
    SHA256 = "sha256"
    #: No signature; signed by a key not trusted here; a signature that does not verify.
    UNSIGNED = "unsigned"
    UNKNOWN_SIGNER = "unknown_signer"
    BAD_SIGNATURE = "bad_signature"
    #: A key file that is not an ed25519 key.
    BAD_KEY = "bad_key"
    #: A signature is required but no key is trusted to check it with (the client without trusted keys).
    NO_TRUSTED_KEYS = "no_trusted_keys"
    #: The record is for another graph key, or another GPU environment.
    GRAPH_KEY = "graph_key"
    ENVIRONMENT = "environment"
    #: A signed record older than one already accepted for its graph key and environment (a replay), or an index root
    #: older than one accepted before.
    REVISION = "revision"
    #: A signed index root past its expiry (:mod:`plancache.index`).
    EXPIRED = "expired"
    #: A verified blob that cuDNN refused to load (counted by the client, never raised).
    DESERIALIZE = "deserialize"
    #: A verified plan the client does not load (counted, never raised): one needing more workspace than the hook's
    #: cap, or a python-engine plan (FE's ``CUDNN_FE_PYPLAN`` blob, which FE loads only into an empty graph).
    WORKSPACE = "workspace"
    PYTHON_ENGINE = "python_engine"


class VerificationError(PlanCacheError):
    """A blob failed verification (size, digest, signature, key, environment); ``reason`` says which."""

    code = "verification_failed"
    http_status = 422

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = Reason(reason)


class SignatureError(VerificationError):
    """A signature or key failed: ``reason`` is ``unsigned``, ``unknown_signer``, ``bad_signature``, ``malformed``
    (a signed payload that is not the statement expected) or ``bad_key``."""


class GpuUnavailable(PlanCacheError):
    """No CUDA device, no cuDNN, or no nvidia-cudnn-frontend in this process."""

    code = "gpu_unavailable"
    http_status = 503


class ForkedProcess(PlanCacheError):
    """A :class:`~plancache.client.PlanCache` used in a process forked from the one that made it (which would share
    the parent's locks, threads and server connections; CUDA does not survive a fork either): make one in the child."""

    code = "forked_process"


class InsufficientGpuMemory(PlanCacheError):
    """The spec needs more device memory than the GPU has; refused before allocating."""

    code = "insufficient_gpu_memory"
    http_status = 422


class TuningError(PlanCacheError):
    """No candidate plan built, ran and matched the reference."""

    code = "tuning_failed"
    http_status = 422


class DynamicShapesUnsupported(TuningError):
    """The graph cannot be built with dynamic shapes from a shared kernel cache."""

    code = "dynamic_shapes_unsupported"


class PlanMiss(PlanCacheError):
    """Strict mode: no verified plan was available and building locally is not allowed."""

    code = "plan_miss"
    http_status = 404


class UnsupportedGraph(SpecError):
    """A pygraph holds something the document cannot represent (a callback, a framework object)."""

    code = "unsupported_graph"


class InvalidValue(PlanCacheError, ValueError):
    """An argument the store cannot take (out of a column's range, negative page, unknown status…)."""

    code = "invalid_value"
    http_status = 422


class SchemaNotReady(PlanCacheError):
    """The database has no schema, or not the one this version of plancache needs."""

    code = "schema_not_ready"
    http_status = 503


class SchemaTooNew(SchemaNotReady):
    """The database is at a schema revision this version of plancache does not have: a newer one migrated it."""

    code = "schema_too_new"


class BlobStoreMismatch(PlanCacheError):
    """The configured blob store (``PLANCACHE_BLOB_STORE``) is not where the database's blobs are."""

    code = "blob_store_mismatch"
    http_status = 503


class BlobStoreUnavailable(RetryLater, OSError):
    """The blob store could not be reached or refused the call (object storage unreachable, denied or failing);
    ``retry_after``: when to ask again (the server's ``Retry-After``)."""

    code = "blob_store_unavailable"
    http_status = 503


class ServerUnavailable(PlanCacheError):
    """The plancache server could not be used (unreachable, timed out, 429 or 5xx, or a malformed answer).

    ``skipped``: no request was sent (a circuit breaker held it back after an earlier failure). ``throttled``: the
    server answered 429 (this caller is over a budget of the route it called).
    """

    code = "server_unavailable"
    http_status = 503

    #: whether sending the call again may help (a :class:`~plancache.http.Retry` sends it again only then)
    retryable = True

    def __init__(self, message: str | None = None, *, skipped: bool = False, throttled: bool = False) -> None:
        super().__init__(message)
        self.skipped = skipped
        self.throttled = throttled


class ServerSpeaksHttp(ServerUnavailable):
    """An ``https://`` server URL whose server answered the TLS handshake in plain HTTP: use its ``http://`` URL,
    or put TLS in front of it. Sending the call again cannot help."""

    code = "server_speaks_http"
    retryable = False


class RequestRefused(PlanCacheError):
    """The server refused the request with an error code this package has no class for.

    ``code`` and ``http_status`` are the answer's.
    """

    def __init__(self, message: str | None = None, *, code: str, http_status: int) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status


def _tree(cls: type[PlanCacheError]) -> Iterator[type[PlanCacheError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _tree(sub)


#: The class of each error code, for raising a server's refusal as what it is. Derived from the tree: every
#: class made from its message alone. One with more fields (a verification ``reason``, the transport errors
#: above) is not rebuilt from an answer, which carries only code and message: it arrives as RequestRefused.
BY_CODE: Mapping[str, type[PlanCacheError]] = MappingProxyType(
    {cls.code: cls for cls in _tree(PlanCacheError) if cls.__init__ is PlanCacheError.__init__})

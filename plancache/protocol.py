"""Wire models of the v1 HTTP API, shared by server, worker and client (pydantic only)."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from annotated_types import Ge, Le
from pydantic import BeforeValidator, Field, StringConstraints, TypeAdapter, field_validator, model_validator

from .environment import ENV_ID_PATTERN, VALIDITY_FIELDS, Environment, FrontendVersion, Sm, SmCount, Version
from .errors import Reason
from .validation import (
    INT32_MAX,
    INT64_MAX,
    Int,
    Int32,
    Int64,
    MaybeError,
    MaybeMillis,
    Millis,
    Seconds,
    StrictModel,
    refuse_bool,
)

Role = Literal["reader", "worker", "admin"]
#: A job's status, the strings the ``jobs.status`` column holds: queued → running → succeeded or failed (a failed
#: attempt with attempts left goes back to queued).
JobStatus = Literal["queued", "running", "succeeded", "failed"]
JOB_STATUSES: tuple[JobStatus, ...] = get_args(JobStatus)
#: Statuses of a job that is still to be tuned, and of one that has ended.
ACTIVE_JOB_STATUSES: tuple[JobStatus, ...] = ("queued", "running")
FINISHED_JOB_STATUSES: tuple[JobStatus, ...] = ("failed", "succeeded")
#: The largest job id: ``jobs.id`` is an ``INTEGER`` column.
MAX_JOB_ID = INT32_MAX
#: A job's id, wherever one is read (a body, a path, a header).
JobId = Annotated[int, Ge(1), Le(MAX_JOB_ID), BeforeValidator(refuse_bool)]


def is_job_id(value: int) -> bool:
    """Whether ``value`` is within :data:`JobId`'s bounds (a larger one names no job, and overflows a query)."""
    return 1 <= value <= MAX_JOB_ID


#: Who asked for a job (``plancache.store.models.JOB_SOURCES``): the server's autotune policy, an admin, a re-tune
#: campaign, or ``plancache enqueue`` of a capture file.
JobSource = Literal["auto", "admin", "campaign", "capture"]
CandidateStatus = Literal["ok", "build_failed", "run_failed", "mismatch"]
#: torch's own attention kernels (its flash-attention; ATen's cuDNN attention) this release's workers time beside an
#: SDPA plan and its clients run. A record may name others (a later release's kernel): it is read, never run.
NATIVE_KERNELS: tuple[str, ...] = ("flash", "cudnn_aten")
NATIVE_KERNEL_PATTERN = r"^[a-z][a-z0-9_]{0,31}$"
MAX_NATIVE_KERNELS = 8

#: A sha256 hex digest (a blob's; a graph key is one too): 64 lowercase hex characters.
SHA256_PATTERN = r"^[0-9a-f]{64}$"
GRAPH_KEY_PATTERN = SHA256_PATTERN
GraphKey = str
#: Graph keys one request may name (resolve: also at most ``PLANCACHE_MAX_RESOLVE_KEYS``; tune: graph keys × targets
#: at most 10,000 jobs).
MAX_KEYS_PER_REQUEST = 10_000
#: Knobs of one plan or candidate (cuDNN has 43 knob types).
MAX_KNOBS = 64
GraphKeyStr = Annotated[str, StringConstraints(pattern=GRAPH_KEY_PATTERN)]
#: Knob name → value, as cuDNN names them (``knob_type`` members, e.g. ``SPLIT_K``: identifiers of up to 64
#: characters, so that a record's knobs stay a few KiB).
KNOB_NAME_PATTERN = r"^[A-Za-z0-9_.]{1,64}$"
Knobs = Annotated[dict[Annotated[str, StringConstraints(pattern=KNOB_NAME_PATTERN)], Int64],
                  Field(json_schema_extra={"additionalProperties": False})]
#: Job priorities: higher is claimed first.
PRIORITY_MAX = 1_000_000
LEASE_TOKEN_MAX_LENGTH = 128
#: Random bytes of a lease token, drawn by the store or proposed by a worker's claim (256 bits: not guessable).
LEASE_TOKEN_BYTES = 32
#: A worker id: printable ASCII, up to 256 characters, no space at either end (it travels in a header of blob
#: uploads, ``X-Plancache-Worker``, where other characters cannot go).
WORKER_ID_PATTERN = r"^[!-~](?:[ -~]{0,254}[!-~])?$"
WorkerId = Annotated[str, StringConstraints(pattern=WORKER_ID_PATTERN)]


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


#: Characters :func:`b64decode` decodes at a time (a multiple of 4).
B64_CHUNK = 4 << 20


def b64decode(text: str, what: str = "blob") -> bytes:
    """Strict base64 decode; raises ``ValueError`` naming ``what``. A long text is decoded 4 MiB at a time, so a
    thread decoding a large plan lets other threads run in between (padding only at the very end)."""
    try:
        if len(text) <= B64_CHUNK:
            return base64.b64decode(text, validate=True)
        parts = []
        for start in range(0, len(text), B64_CHUNK):
            part = text[start:start + B64_CHUNK]
            if start + B64_CHUNK < len(text) and "=" in part:
                raise ValueError("Excess data after padding")
            parts.append(base64.b64decode(part, validate=True))
        return b"".join(parts)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{what} is not valid base64: {exc}") from exc


class TargetEnvironment(StrictModel):
    """Which environments a tuning job is for. A field left ``None`` matches any value."""

    sm: Sm | None = None
    sm_count: SmCount | None = None
    cudnn_version: Version | None = None
    driver_version: Version | None = None
    frontend_version: FrontendVersion | None = None

    def matches(self, env: Environment) -> bool:
        return all(getattr(self, f) is None or getattr(self, f) == getattr(env, f) for f in VALIDITY_FIELDS)

    @classmethod
    def exactly(cls, env: Environment) -> TargetEnvironment:
        return cls(**env.validity())


class Candidate(StrictModel):
    """One candidate execution plan seen during autotuning."""

    index: Int = Field(ge=0, le=INT32_MAX)
    engine_id: Int | None = Field(default=None, ge=-INT64_MAX, le=INT64_MAX)
    knobs: Knobs = Field(default_factory=dict, max_length=MAX_KNOBS)
    name: str = Field(default="", max_length=512)
    workspace_bytes: Int | None = Field(default=None, ge=0, le=INT64_MAX)
    median_ms: MaybeMillis = None
    max_abs_err: MaybeError = None
    status: CandidateStatus
    error: str | None = Field(default=None, max_length=4000)


#: The candidates table of a tuning run keeps at most this many rows (:meth:`CandidateTable.best_of`) ...
MAX_CANDIDATES = 512
#: ... and at most this many bytes of JSON (a typical row is 100-300 bytes; one at every bound about 27 KiB).
MAX_CANDIDATES_BYTES = 1 << 20
_CANDIDATE_LIST: TypeAdapter[list[Candidate]] = TypeAdapter(list[Candidate])
#: The statuses of a table's rows, best first: the order :meth:`CandidateTable.best_of` keeps them in.
_STATUS_RANK = {"ok": 0, "mismatch": 1, "run_failed": 2, "build_failed": 3}


class CandidateTable(StrictModel):
    """The candidates table of a tuning run, bounded: at most :data:`MAX_CANDIDATES` rows and
    :data:`MAX_CANDIDATES_BYTES` bytes of JSON, and how many more candidates were tried, by status. The server stores
    it apart from the plan record (an admin reads it); a table over either bound is refused, never cut."""

    candidates: list[Candidate] = Field(default_factory=list, max_length=MAX_CANDIDATES,
                                        description=f"at most {MAX_CANDIDATES} rows and {MAX_CANDIDATES_BYTES} bytes "
                                                    "of JSON: the best ones (CandidateTable.best_of)")
    candidates_omitted: dict[CandidateStatus, Annotated[Int, Field(ge=0, le=INT64_MAX)]] = Field(
        default_factory=dict, description="candidates tried but not in the table, by status")

    @field_validator("candidates", mode="before")
    @classmethod
    def _at_most(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_CANDIDATES:
            raise ValueError(f"{len(value)} candidates; a plan carries at most {MAX_CANDIDATES}: send the best ones "
                             "and count the rest in candidates_omitted (CandidateTable.best_of does)")
        return value

    @model_validator(mode="after")
    def _within_bytes(self) -> CandidateTable:
        size = len(_CANDIDATE_LIST.dump_json(self.candidates))
        if size > MAX_CANDIDATES_BYTES:
            raise ValueError(f"the candidates table is {size} bytes of JSON; at most {MAX_CANDIDATES_BYTES} are "
                             "stored: send the best ones and count the rest in candidates_omitted "
                             "(CandidateTable.best_of does)")
        return self

    @classmethod
    def best_of(cls, candidates: list[Candidate]) -> CandidateTable:
        """The table of a tuning run: its best candidates (``ok`` fastest first, then ``mismatch``, ``run_failed``,
        ``build_failed``) while they fit both bounds, in the run's order; the others counted by status."""
        ranked = sorted(candidates, key=lambda c: (_STATUS_RANK[c.status], c.median_ms or 0.0, c.index))
        kept: list[Candidate] = []
        size = 2  # the list's brackets
        omitted: dict[CandidateStatus, int] = {}
        for c in ranked:
            row = len(c.model_dump_json()) + 1  # and its comma
            if len(kept) < MAX_CANDIDATES and size + row <= MAX_CANDIDATES_BYTES:
                kept.append(c)
                size += row
            else:
                omitted[c.status] = omitted.get(c.status, 0) + 1
        kept.sort(key=lambda c: c.index)
        return cls(candidates=kept, candidates_omitted=omitted)


#: Longest base64 DSSE payload accepted: a plan statement is about 1 KiB and 11 KiB at every field's bound (64 knobs),
#: a withdrawal's 9 KiB at most (:data:`MAX_WITHDRAWAL_REASON`).
MAX_ENVELOPE_PAYLOAD = 16 << 10
#: A key id, as :func:`plancache.signing.key_id` makes them (16 hex characters) or another signer names its key.
KEY_ID_PATTERN = r"^[A-Za-z0-9._:/+=-]{1,128}$"
#: Base64, standard or URL-safe alphabet (a DSSE payload or signature).
BASE64_PATTERN = r"^[A-Za-z0-9+/_-]*={0,2}$"


class DsseSignature(StrictModel):
    """One signature of a DSSE envelope: the signer's key id and the base64 ed25519 signature of the PAE."""

    keyid: str = Field(pattern=KEY_ID_PATTERN)
    sig: str = Field(min_length=1, max_length=512, pattern=BASE64_PATTERN)


class Envelope(StrictModel):
    """A DSSE envelope (secure-systems-lab/dsse on GitHub), field names as the standard spells them:
    ``payload`` is the base64 of the signed document, whose type ``payloadType`` names; each signature covers
    the pre-authentication encoding of both (:func:`plancache.signing.pae`)."""

    payloadType: str = Field(min_length=1, max_length=128)  # noqa: N815 - the DSSE field name
    payload: str = Field(min_length=1, max_length=MAX_ENVELOPE_PAYLOAD, pattern=BASE64_PATTERN)
    signatures: list[DsseSignature] = Field(min_length=1, max_length=8)


#: The largest JSON a :class:`PlanRecord` can have, every field at its bound (tests/unit/test_record_bounds.py
#: builds it): a resolve answer for N keys, records only, is at most N times this (and ``blob_url``).
MAX_RECORD_BYTES = 64 << 10


class PlanMeta(StrictModel):
    """Everything a plan record states about a blob, as produced by a worker. ``envelope`` signs the record
    (:mod:`plancache.signing`): a signed record is authentic only when its fields equal those of the envelope's
    statement; ``revision`` orders the signed records of one graph key and environment (higher is newer). Every
    field is bounded (:data:`MAX_RECORD_BYTES` in all); the tuning run's candidates travel beside it
    (:class:`CandidateTable`), never in it."""

    graph_key: GraphKey = Field(pattern=GRAPH_KEY_PATTERN)
    environment: Environment
    blob_sha256: str = Field(pattern=SHA256_PATTERN)
    blob_size: Int = Field(ge=1, le=INT64_MAX)
    envelope: Envelope | None = Field(default=None, description="DSSE envelope of the signed in-toto statement")
    revision: Int = Field(default=0, ge=0, le=INT64_MAX, description="set by the signer (by default its signing time "
                          "in milliseconds, strictly increasing); a replacement must have a higher one")
    engine_id: Int = Field(ge=-INT64_MAX, le=INT64_MAX)
    knobs: Knobs = Field(default_factory=dict, max_length=MAX_KNOBS)
    plan_name: str = Field(default="", max_length=512)
    workspace_bytes: Int = Field(ge=0, le=INT64_MAX)
    winner_median_ms: Millis
    heuristic_median_ms: Millis | None = None
    worst_median_ms: Millis | None = None
    native_median_ms: dict[Annotated[str, StringConstraints(pattern=NATIVE_KERNEL_PATTERN)], Millis] = Field(
        default_factory=dict, max_length=MAX_NATIVE_KERNELS, json_schema_extra={"additionalProperties": False},
        description="median ms of torch's own kernels for the same attention call, timed by the worker beside the "
                    "winner (flash, cudnn_aten); empty for other graphs")
    tuning_seconds: Seconds
    worker_id: str = Field(min_length=1, max_length=256)
    numerics_check: str = Field(
        default="reference", pattern=r"^(reference|cross-check:fallback|cross-check:heuristic)$",
        description="how the winner's numerics were checked: the float32 torch reference of every node, or, for a "
                    "graph no reference covers, against cuDNN's FALLBACK plan or its heuristic choice")

    @property
    def signer_key_id(self) -> str | None:
        """The key id of the envelope's first signature; None for an unsigned record."""
        return self.envelope.signatures[0].keyid if self.envelope else None


#: Why a plan upload that carries its blob inline (``blob_b64``) is refused.
INLINE_BLOB_REFUSED = ("blob_b64 is not accepted: a plan upload carries its record alone; upload the blob raw with "
                       "PUT /v1/blobs/{sha256} first, then the record (a worker that sends blob_b64 must be upgraded)")
#: Why a plan upload that names a job (``job_id``, ``lease_token``) is refused: a job has one completion route.
JOB_UPLOAD_REFUSED = ("job_id and lease_token are not accepted here: a worker publishes its job's plan with "
                      "POST /v1/jobs/{id}/complete (its lease and the plan); PUT /v1/plans is an admin's upload "
                      "outside the job queue")


class PlanUpload(PlanMeta, CandidateTable):
    """``PUT /v1/plans`` body (and a job completion's ``plan``): the record, optionally its spec, and the tuning
    run's candidates table (stored apart from the record). The blob is not in it: it is uploaded raw before, with
    ``PUT /v1/blobs/{sha256}``, and a body that carries one (``blob_b64``) is refused (422) with a message saying so;
    so is one that names a job (``job_id``, ``lease_token``): a job is completed by its own route."""

    spec: dict[str, Any] | None = None
    replace: bool = Field(default=False, description="replace an existing plan for this key+environment")

    @model_validator(mode="before")
    @classmethod
    def _refused_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "blob_b64" in data:
            raise ValueError(INLINE_BLOB_REFUSED)
        if isinstance(data, dict) and ("job_id" in data or "lease_token" in data):
            raise ValueError(JOB_UPLOAD_REFUSED)
        return data


class PlanRecord(PlanMeta):
    """A stored plan record. A ``candidates`` list in its input (a record an older server answered, or a client
    cache or bundle wrote) is dropped: candidates are not part of a record, nor of its signed statement."""

    env_id: str = Field(pattern=ENV_ID_PATTERN)
    job_id: JobId | None = None
    created_at: datetime

    @model_validator(mode="before")
    @classmethod
    def _drop_candidates(cls, data: Any) -> Any:
        if isinstance(data, dict) and "candidates" in data:
            data = {k: v for k, v in data.items() if k != "candidates"}
        return data

    def file_json(self) -> dict[str, Any]:
        """The record as a bundle entry or an index shard holds it: its JSON less an empty ``native_median_ms``, so
        that a release that lacks the field (it reads those files strictly) reads a record without native timings."""
        return self.model_dump(mode="json", exclude=None if self.native_median_ms else {"native_median_ms"})


class PlanCandidates(CandidateTable):
    """``GET /v1/plans/{graph_key}/candidates``: the candidates table of the tuning run of the stored plan
    (``blob_sha256``, ``revision``) of ``graph_key`` on ``env_id``."""

    graph_key: GraphKey
    env_id: str = Field(pattern=ENV_ID_PATTERN)
    blob_sha256: str = Field(pattern=SHA256_PATTERN)
    revision: Int = Field(ge=0, le=INT64_MAX)


#: Longest reason a withdrawal may give.
MAX_WITHDRAWAL_REASON = 1000


class Withdrawal(StrictModel):
    """A plan an admin withdrew: the plan of ``graph_key`` on ``environment`` whose record had ``withdrawn_revision``
    (and blob ``blob_sha256``) is no longer served, and clients drop it, for ``reason``. Signed like a plan record
    (``envelope``, :mod:`plancache.signing`); its ``revision`` is above the withdrawn record's, and only a plan of a
    higher revision than the withdrawal's takes its place."""

    graph_key: GraphKey = Field(pattern=GRAPH_KEY_PATTERN)
    environment: Environment
    blob_sha256: str = Field(pattern=SHA256_PATTERN)
    withdrawn_revision: Int = Field(ge=0, le=INT64_MAX)
    revision: Int = Field(default=0, ge=0, le=INT64_MAX, description="set by the signer, above withdrawn_revision")
    reason: str = Field(min_length=1, max_length=MAX_WITHDRAWAL_REASON)
    envelope: Envelope | None = Field(default=None, description="DSSE envelope of the signed in-toto statement")


class SignedWithdrawal(Withdrawal):
    """``POST /v1/admin/withdrawals`` body: a withdrawal with its envelope."""

    envelope: Envelope = Field(description="DSSE envelope of the signed in-toto statement")


class WithdrawalRecord(Withdrawal):
    """A stored withdrawal."""

    env_id: str
    created_at: datetime


class ResolveRequest(StrictModel):
    environment: Environment
    graph_keys: list[GraphKeyStr] = Field(min_length=1, max_length=MAX_KEYS_PER_REQUEST,
                                          description="at most PLANCACHE_MAX_RESOLVE_KEYS (default 1000): 413 past it")
    include_blobs: bool = False


class ResolvedPlan(StrictModel):
    """A plan of a resolve answer: its record and, with ``include_blobs``, its blob inline (``blob_b64``), else where
    to GET the blob (``blob_url``): the server's own route (relative, ``/v1/blobs/{sha256}``, sent with the token) or
    a presigned object-store URL (absolute, short-lived, sent without credentials). Whoever serves the bytes, the
    client checks them against the record (size, sha256, signature)."""

    record: PlanRecord
    blob_b64: str | None = None
    blob_url: str | None = Field(default=None, max_length=8192,
                                 description="where to GET the blob when it is not inline: /v1/blobs/{sha256} on this "
                                             "server, or an absolute presigned URL (no Authorization header)")


class ResolveResponse(StrictModel):
    """The plans found, the keys ``missing``, and for each missing key why (``reasons``: the reason ``explain``
    gives, read once the miss is recorded; absent from a server of API 1.1 or older)."""

    plans: dict[GraphKey, ResolvedPlan]
    missing: list[GraphKey]
    reasons: dict[GraphKey, MissReason] = Field(default_factory=dict)


#: Why a graph key has no plan on an environment, most actionable first (:class:`MissReason`).
MissReasonCode = Literal["planned", "withdrawn", "running", "queued", "failed", "other_environments", "not_queued",
                         "not_registered"]


class MissReason(StrictModel):
    """Why ``graph_key`` has no plan on the environment asked about, in words a user acts on. ``planned``: it has
    one now. ``differs``: for ``other_environments``, the validity fields in which the nearest environment that has
    a plan differs from the one asked about. ``withdrawal``: for ``withdrawn``, the signed withdrawal (a client that
    verifies it drops its copy of the plan)."""

    reason: MissReasonCode
    message: str = Field(max_length=2000)
    job_id: JobId | None = None
    differs: list[str] = Field(default_factory=list, max_length=len(VALIDITY_FIELDS))
    withdrawal: Withdrawal | None = None


class ExplainRequest(StrictModel):
    environment: Environment
    graph_keys: list[GraphKeyStr] = Field(min_length=1, max_length=MAX_KEYS_PER_REQUEST)


class ExplainResponse(StrictModel):
    reasons: dict[GraphKey, MissReason]


#: Graph keys one siblings request may name, and the most siblings it asks for per key (``limit``).
MAX_SIBLING_KEYS, MAX_SIBLINGS = 16, 64


class SiblingsRequest(StrictModel):
    """The tuned plans of other shapes of ``graph_keys`` on ``environment``: graphs that differ from one of them only
    in batch size and sequence lengths (:func:`plancache.spec.axes.sibling_key`), up to ``limit`` per key."""

    environment: Environment
    graph_keys: list[GraphKeyStr] = Field(min_length=1, max_length=MAX_SIBLING_KEYS)
    limit: int = Field(default=16, ge=1, le=MAX_SIBLINGS)


class SiblingsResponse(StrictModel):
    """Each sibling's canonical spec (a schema-2 document), by graph key, the most recently published first; the
    keys asked about are left out."""

    specs: dict[GraphKey, dict[str, Any]]


class SpecCreated(StrictModel):
    graph_key: GraphKey
    created: bool


#: The longest a token may live from its creation: ten years, in seconds.
MAX_TOKEN_LIFETIME_SECONDS = 10 * 365 * 86400
#: A token's name: a host or team, 1-128 characters without surrounding spaces.
TOKEN_NAME_MAX_LENGTH = 128


class TokenInfo(StrictModel):
    """What is told about an API token (never its secret): ``expires_at`` None never expires."""

    id: Int
    name: str
    role: Role
    created_at: datetime
    revoked: bool
    expires_at: datetime | None = None


class TokenCreate(StrictModel):
    """``POST /v1/admin/tokens``: a new token of ``role`` named ``name`` (unique among live tokens), valid for
    ``expires_in_seconds`` (None: until revoked)."""

    name: str = Field(min_length=1, max_length=TOKEN_NAME_MAX_LENGTH)
    role: Role
    expires_in_seconds: Int | None = Field(default=None, ge=1, le=MAX_TOKEN_LIFETIME_SECONDS)


class TokenCreated(StrictModel):
    """The new token: its secret, shown in this answer only, and what is told about it."""

    token: str
    info: TokenInfo


class TokenList(StrictModel):
    tokens: list[TokenInfo]


#: A :class:`~plancache.errors.Reason` value.
REASON_PATTERN = "^(" + "|".join(reason.value for reason in Reason) + ")$"
#: The most a report may say of one reason (a process's count since its last report).
MAX_REPORTED_REJECTS = 1_000_000_000


class RejectReport(StrictModel):
    """``POST /v1/reports/rejects``: how many plans a client refused since its last report, by reason (the
    :class:`~plancache.errors.Reason` members: a bounded set the server counts under)."""

    rejects: dict[Annotated[str, StringConstraints(pattern=REASON_PATTERN)],
                  Annotated[Int, Field(ge=1, le=MAX_REPORTED_REJECTS)]] = Field(
        min_length=1, max_length=len(Reason), json_schema_extra={"additionalProperties": False})  # reasons only


class TuneRequest(StrictModel):
    """``POST /v1/admin/tune``: tune these graph keys and/or specs on each target."""

    graph_keys: list[GraphKeyStr] = Field(default_factory=list, max_length=MAX_KEYS_PER_REQUEST)
    specs: list[dict[str, Any]] = Field(default_factory=list, max_length=1000, description="GraphSpec documents")
    targets: list[TargetEnvironment] = Field(min_length=1, max_length=100)
    priority: Int = Field(default=0, ge=-PRIORITY_MAX, le=PRIORITY_MAX)
    max_attempts: Int | None = Field(default=None, ge=1, le=100)
    source: Literal["admin", "capture"] = Field(default="admin", description="``capture``: the keys come from a "
                                                "capture file (``plancache enqueue``); new jobs carry it")


class EnqueueMissesRequest(StrictModel):
    """``POST /v1/admin/tune/misses``: enqueue the ``top`` most-missed keys of ``environment``."""

    environment: Environment
    top: Int = Field(default=10, ge=1, le=10_000)
    priority: Int = Field(default=0, ge=-PRIORITY_MAX, le=PRIORITY_MAX)


class Job(StrictModel):
    id: JobId
    graph_key: GraphKey
    target: TargetEnvironment
    status: JobStatus
    priority: Int32
    attempts: Int = Field(ge=0, le=INT32_MAX)
    max_attempts: Int = Field(ge=0, le=INT32_MAX)
    lease_owner: str | None = Field(default=None, description="the worker id of the lease; shown to admins and to the "
                                                              "lease's holder only")
    lease_holder: str | None = Field(default=None, description="the API token that claimed the lease (``token:<id>``); "
                                                               "shown to admins only")
    lease_expires_at: datetime | None = None
    error: str | None = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    source: JobSource = Field(default="admin", description="who asked for it: the autotune policy (``auto``), an "
                                                           "admin, a re-tune campaign, a capture file")


class JobList(StrictModel):
    jobs: list[Job]


class CancelRequest(StrictModel):
    """``POST /v1/admin/jobs/{id}/cancel`` body (optional)."""

    reason: str = Field(default="", max_length=1000, pattern=r"^[^\x00-\x1f\x7f]*$",
                        description="why, kept in the job's error after who cancelled it (one line)")


class ClaimRequest(StrictModel):
    environment: Environment
    worker_id: WorkerId = Field(description="printable ASCII, 1 to 256 characters, no space at either end")
    lease_token: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_-]{32,128}$",
        description="the worker's own secret for this claim's lease (url-safe base64, 32 to 128 characters); the "
                    "same claim sent again with it, its answer lost, gets the job it leased then")


class ClaimResponse(StrictModel):
    job: Job
    spec: dict[str, Any]
    lease_token: str = Field(description="the lease's secret fencing token, given only here: send it back with "
                                         "heartbeat/complete/fail, from the API token that claimed the job")
    lease_expires_at: datetime
    min_revision: Int = Field(default=0, ge=0, le=INT64_MAX,
                              description="the plan published for this job must have a higher revision (a withdrawal's "
                                          "on the claimer's environment; 0: none)")


class LeaseRequest(StrictModel):
    worker_id: WorkerId
    lease_token: str = Field(min_length=1, max_length=LEASE_TOKEN_MAX_LENGTH)


class CompleteRequest(LeaseRequest):
    plan: PlanUpload


class FailRequest(LeaseRequest):
    error: str = Field(min_length=1, max_length=8000)
    retryable: bool = True
    released: bool = Field(default=False, description="the worker stopped before the attempt ended: the job goes "
                                                      "back to the queue and the attempt is not counted")


class Miss(StrictModel):
    graph_key: GraphKey
    env_id: str
    environment: Environment
    count: Int = Field(ge=0, le=INT64_MAX)
    first_seen: datetime
    last_seen: datetime


class MissList(StrictModel):
    misses: list[Miss]


class ErrorBody(StrictModel):
    code: str
    message: str


class ErrorResponse(StrictModel):
    error: ErrorBody

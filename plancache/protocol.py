"""Wire models of the v1 HTTP API, shared by server, worker and client (pydantic only)."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, model_validator

from .environment import VALIDITY_FIELDS, Environment, Int, refuse_bool

Role = Literal["reader", "worker", "admin"]
JobStatus = Literal["queued", "running", "succeeded", "failed"]
CandidateStatus = Literal["ok", "build_failed", "run_failed", "mismatch"]

SHA256_PATTERN = r"^[0-9a-f]{64}$"
GRAPH_KEY_PATTERN = r"^[0-9a-f]{64}$"
GraphKey = str
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
#: Graph keys one request may name (resolve: also at most ``PLANCACHE_MAX_RESOLVE_KEYS``; tune: graph keys × targets
#: at most 10,000 jobs).
MAX_KEYS_PER_REQUEST = 10_000
#: Knobs of one plan or candidate (cuDNN has 43 knob types), and the length of a knob's name.
MAX_KNOBS = 64
Int32 = Annotated[int, Ge(-INT32_MAX - 1), Le(INT32_MAX), BeforeValidator(refuse_bool)]
Int64 = Annotated[int, Ge(-INT64_MAX - 1), Le(INT64_MAX), BeforeValidator(refuse_bool)]
GraphKeyStr = Annotated[str, StringConstraints(pattern=GRAPH_KEY_PATTERN)]
#: Knob name → value, as cuDNN names them (``knob_type`` members, e.g. ``SPLIT_K``).
Knobs = dict[Annotated[str, StringConstraints(min_length=1, max_length=64)], Int64]
#: Job priorities: higher is claimed first.
PRIORITY_MAX = 1_000_000
LEASE_TOKEN_MAX_LENGTH = 128


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


#: Characters :func:`b64decode` decodes at a time (a multiple of 4).
B64_CHUNK = 4 << 20


def b64decode(text: str, what: str = "blob") -> bytes:
    """Strict base64 decode; raises ``ValueError`` naming ``what``. A long text is decoded 4 MiB at a time, so a
    server thread decoding a large plan lets the event loop run in between (padding only at the very end)."""
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


class TargetEnvironment(_Model):
    """Which environments a tuning job is for. A field left ``None`` matches any value."""

    sm: Int | None = Field(default=None, ge=10, le=1000)
    sm_count: Int | None = Field(default=None, ge=1, le=100_000)
    cudnn_version: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    driver_version: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    frontend_version: str | None = Field(default=None, min_length=1, max_length=64)

    def matches(self, env: Environment) -> bool:
        return all(getattr(self, f) is None or getattr(self, f) == getattr(env, f) for f in VALIDITY_FIELDS)

    @classmethod
    def exactly(cls, env: Environment) -> "TargetEnvironment":
        return cls(**env.validity())


class Candidate(_Model):
    """One candidate execution plan seen during autotuning."""

    index: Int = Field(ge=0, le=INT32_MAX)
    engine_id: Int | None = Field(default=None, ge=-INT64_MAX, le=INT64_MAX)
    knobs: Knobs = Field(default_factory=dict, max_length=MAX_KNOBS)
    name: str = Field(default="", max_length=512)
    workspace_bytes: Int | None = Field(default=None, ge=0, le=INT64_MAX)
    median_ms: float | None = Field(default=None, ge=0)
    max_abs_err: float | None = None
    status: CandidateStatus
    error: str | None = Field(default=None, max_length=4000)


class PlanMeta(_Model):
    """Everything a plan record states about a blob, as produced by a worker."""

    graph_key: GraphKey = Field(pattern=GRAPH_KEY_PATTERN)
    environment: Environment
    blob_sha256: str = Field(pattern=SHA256_PATTERN)
    blob_size: Int = Field(ge=1, le=INT64_MAX)
    signature: str | None = Field(default=None, max_length=512, description="base64 ed25519 signature")
    signer_key_id: str | None = Field(default=None, max_length=128)
    engine_id: Int = Field(ge=-INT64_MAX, le=INT64_MAX)
    knobs: Knobs = Field(default_factory=dict, max_length=MAX_KNOBS)
    plan_name: str = Field(default="", max_length=512)
    workspace_bytes: Int = Field(ge=0, le=INT64_MAX)
    winner_median_ms: float = Field(ge=0)
    heuristic_median_ms: float | None = Field(default=None, ge=0)
    worst_median_ms: float | None = Field(default=None, ge=0)
    candidates: list[Candidate] = Field(default_factory=list, max_length=10_000)
    tuning_seconds: float = Field(ge=0)
    worker_id: str = Field(min_length=1, max_length=256)
    numerics_check: str = Field(
        default="reference", pattern=r"^(reference|cross-check:fallback|cross-check:heuristic)$",
        description="how the winner's numerics were checked: the float32 torch reference of every node, or, for a "
                    "graph no reference covers, against cuDNN's FALLBACK plan or its heuristic choice")


class PlanUpload(PlanMeta):
    """``PUT /v1/plans`` body: the record plus the blob inline (base64) and, optionally, its spec."""

    blob_b64: str = Field(min_length=1)
    spec: dict[str, Any] | None = None
    replace: bool = Field(default=False, description="replace an existing plan for this key+environment")

    def blob_bytes(self) -> bytes:
        return b64decode(self.blob_b64)


class PlanPut(PlanUpload):
    """``PUT /v1/plans`` body. A worker token publishes only the plan of a job it holds: ``job_id`` and the
    ``lease_token`` of its claim (``worker_id`` is the lease's), and the upload completes that job. An admin
    token may leave both out and upload for any key and environment."""

    job_id: Int | None = Field(default=None, ge=1, le=INT32_MAX)
    lease_token: str | None = Field(default=None, min_length=1, max_length=LEASE_TOKEN_MAX_LENGTH)

    @model_validator(mode="after")
    def _lease_together(self) -> "PlanPut":
        if (self.job_id is None) != (self.lease_token is None):
            raise ValueError("job_id and lease_token are sent together")
        return self


class PlanRecord(PlanMeta):
    """A stored plan record."""

    env_id: str
    job_id: Int | None = Field(default=None, ge=1, le=INT64_MAX)
    created_at: datetime


class ResolveRequest(_Model):
    environment: Environment
    graph_keys: list[GraphKeyStr] = Field(min_length=1, max_length=MAX_KEYS_PER_REQUEST,
                                          description="at most PLANCACHE_MAX_RESOLVE_KEYS (default 1000): 413 past it")
    include_blobs: bool = False


class ResolvedPlan(_Model):
    record: PlanRecord
    blob_b64: str | None = None


class ResolveResponse(_Model):
    plans: dict[GraphKey, ResolvedPlan]
    missing: list[GraphKey]


class SpecCreated(_Model):
    graph_key: GraphKey
    created: bool


class TuneRequest(_Model):
    """``POST /v1/admin/tune``: tune these graph keys and/or specs on each target."""

    graph_keys: list[GraphKeyStr] = Field(default_factory=list, max_length=MAX_KEYS_PER_REQUEST)
    specs: list[dict[str, Any]] = Field(default_factory=list, max_length=1000, description="GraphSpec documents")
    targets: list[TargetEnvironment] = Field(min_length=1, max_length=100)
    priority: Int = Field(default=0, ge=-PRIORITY_MAX, le=PRIORITY_MAX)
    max_attempts: Int | None = Field(default=None, ge=1, le=100)


class EnqueueMissesRequest(_Model):
    """``POST /v1/admin/tune/misses``: enqueue the ``top`` most-missed keys of ``environment``."""

    environment: Environment
    top: Int = Field(default=10, ge=1, le=10_000)
    priority: Int = Field(default=0, ge=-PRIORITY_MAX, le=PRIORITY_MAX)


class Job(_Model):
    id: Int = Field(ge=1, le=INT64_MAX)
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


class JobList(_Model):
    jobs: list[Job]


class ClaimRequest(_Model):
    environment: Environment
    worker_id: str = Field(min_length=1, max_length=256)


class ClaimResponse(_Model):
    job: Job
    spec: dict[str, Any]
    lease_token: str = Field(description="the lease's secret fencing token, given only here: send it back with "
                                         "heartbeat/complete/fail, from the API token that claimed the job")
    lease_expires_at: datetime


class LeaseRequest(_Model):
    worker_id: str = Field(min_length=1, max_length=256)
    lease_token: str = Field(min_length=1, max_length=LEASE_TOKEN_MAX_LENGTH)


class CompleteRequest(LeaseRequest):
    plan: PlanUpload


class FailRequest(LeaseRequest):
    error: str = Field(min_length=1, max_length=8000)
    retryable: bool = True


class Miss(_Model):
    graph_key: GraphKey
    env_id: str
    environment: Environment
    count: Int = Field(ge=0, le=INT64_MAX)
    first_seen: datetime
    last_seen: datetime


class MissList(_Model):
    misses: list[Miss]


class ErrorBody(_Model):
    code: str
    message: str


class ErrorResponse(_Model):
    error: ErrorBody

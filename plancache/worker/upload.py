"""Publish a locally tuned plan straight to the server (``plancache tune --server``), without the job queue."""

from __future__ import annotations

import logging
from typing import Any

from ..environment import Environment
from ..errors import EnvironmentMismatch, IntegrityError, VerificationError
from ..http import Retry
from ..protocol import CandidateTable, PlanMeta, PlanRecord, PlanUpload
from ..signing import Signer
from ..spec import GraphSpec, parse_spec
from ..verify import verify_blob
from .jobs_api import JobsApi
from .tuner import GpuTuner, TunedResult, Tuner

log = logging.getLogger("plancache.worker")

#: How long an upload keeps retrying an unreachable server before giving up.
UPLOAD_RETRY_SECONDS = 60.0


def tuned_meta(tuned: TunedResult, graph_key: str, worker_id: str, environment: Environment) -> PlanMeta:
    """The unsigned record of a freshly tuned plan, once :func:`~plancache.verify.verify_blob` passed its blob
    (size → sha256 → environment): :class:`IntegrityError` or :class:`EnvironmentMismatch` otherwise."""
    meta = tuned.to_meta(graph_key, worker_id)
    try:
        verify_blob(meta, tuned.blob, what=f"the plan tuned for graph {graph_key[:12]}", environment=environment)
    except VerificationError as exc:
        raise (EnvironmentMismatch if exc.reason == "environment" else IntegrityError)(exc.message) from None
    return meta


def upload_tuned(server_url: str, token: str | None, spec: GraphSpec | dict[str, Any], tuned: TunedResult,
                 signer: Signer | None, worker_id: str, *, tuner: Tuner | None = None,
                 retry_for: float = UPLOAD_RETRY_SECONDS) -> PlanRecord:
    """Check ``tuned``'s blob after a deserialize round trip (with ``tuner``, default :class:`GpuTuner` on
    device 0), sign it (unsigned when ``signer`` is None), ``PUT /v1/blobs/{sha256}`` its bytes and ``PUT /v1/plans``
    its record; return the stored record.

    This uploads outside the job queue, which needs an **admin** ``token``: a worker token publishes only
    the plans of jobs it holds, with ``POST /v1/jobs/{id}/complete`` (the worker loop), and is refused here with
    :class:`~plancache.errors.Forbidden`.

    Raises :class:`~plancache.errors.TuningError` when the round trip does not match the reference,
    :class:`~plancache.errors.ServerUnavailable` when the server stays unreachable for
    ``retry_for`` seconds, and the server's refusal (e.g. ``Conflict``, ``Forbidden``) otherwise.
    """
    spec = parse_spec(spec)
    tuner = tuner or GpuTuner()
    meta = tuned_meta(tuned, spec.graph_key, worker_id, tuner.environment())
    err = tuner.verify(spec, tuned.blob)
    if signer is not None:
        meta = signer.sign(meta)
    upload = PlanUpload(**meta.model_dump(), **CandidateTable.best_of(tuned.candidates).model_dump(),
                        spec=spec.to_json())
    with JobsApi.open(server_url, token, retry=Retry(within=retry_for)) as jobs:
        jobs.put_blob(meta.blob_sha256, tuned.blob)  # raw bytes first; then the record alone
        record = jobs.put_plan(upload)
    log.info("uploaded plan %s for graph %s (round trip error %.3g, %s)", record.blob_sha256[:12],
             spec.graph_key[:12], err, f"key {meta.signer_key_id}" if signer else "unsigned")
    return record

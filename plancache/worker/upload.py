"""Publish a locally tuned plan straight to the server (``plancache tune --server``), without the job queue."""

from __future__ import annotations

import hashlib
import logging

from ..errors import EnvironmentMismatch, IntegrityError
from ..protocol import PlanRecord, PlanUpload, b64encode
from ..signing import Signer
from ..spec import GraphSpec, parse_spec
from .client import JobClient
from .tuner import GpuTuner, TunedResult, Tuner

log = logging.getLogger("plancache.worker")

#: How long an upload keeps retrying an unreachable server before giving up.
UPLOAD_RETRY_SECONDS = 60.0


def upload_tuned(server_url: str, token: str | None, spec: GraphSpec | dict, tuned: TunedResult,
                 signer: Signer | None, worker_id: str, *, tuner: Tuner | None = None,
                 retry_for: float = UPLOAD_RETRY_SECONDS) -> PlanRecord:
    """Check ``tuned``'s blob after a deserialize round trip (with ``tuner``, default :class:`GpuTuner` on
    device 0), sign it (unsigned when ``signer`` is None) and ``PUT /v1/plans``; return the stored record.

    Raises :class:`~plancache.errors.TuningError` when the round trip does not match the reference,
    :class:`~plancache.worker.client.ServerUnavailable` when the server stays unreachable for
    ``retry_for`` seconds, and the server's refusal (e.g. ``Conflict``) otherwise.
    """
    spec = parse_spec(spec)
    if len(tuned.blob) == 0 or hashlib.sha256(tuned.blob).hexdigest() != tuned.sha256:
        raise IntegrityError("the tuned blob does not match its sha256")
    tuner = tuner or GpuTuner()
    env = tuner.environment()
    if not tuned.environment.compatible_with(env):
        raise EnvironmentMismatch(f"plan was tuned on {tuned.environment.describe()}, this machine is {env.describe()}")
    err = tuner.verify(spec, tuned.blob)
    meta = tuned.to_meta(spec.graph_key, worker_id)
    if signer is not None:
        meta = signer.sign(meta)
    upload = PlanUpload(**meta.model_dump(), blob_b64=b64encode(tuned.blob), spec=spec.to_json())
    with JobClient(server_url, token) as client:
        record = client.put_plan(upload, retry_for=retry_for)
    log.info("uploaded plan %s for graph %s (round trip error %.3g, %s)", record.blob_sha256[:12],
             spec.graph_key[:12], err, f"key {meta.signer_key_id}" if signer else "unsigned")
    return record

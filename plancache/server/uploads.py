"""What ``PUT /v1/plans`` and job completion share: the checks before a plan reaches the store, and
publishing the plan of a held job."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError

from ..errors import Forbidden, LeaseLost, PayloadTooLarge
from ..protocol import PlanRecord, PlanUpload
from ..settings import ServerSettings
from ..store import Store
from .auth import Principal


def base64_size(n: int) -> int:
    """Length of the base64 text of ``n`` bytes."""
    return 4 * ((n + 2) // 3)


def upload_body_limit(settings: ServerSettings) -> int:
    """The largest plan upload body read: a blob of ``max_blob_bytes`` as base64, plus ``max_json_bytes`` for its
    spec and as much again for its record (candidates and all), and never over ``max_request_bytes``. One that
    declares more is refused (413) before a byte of it is read."""
    return min(settings.max_request_bytes, base64_size(settings.max_blob_bytes) + 2 * settings.max_json_bytes)


def accept_upload(upload: PlanUpload, principal: Principal, store: Store, settings: ServerSettings,
                  loc: tuple[str, ...] = ("body",)) -> bytes | None:
    """The upload's blob, decoded and within ``ServerSettings.max_blob_bytes`` (None when it was uploaded before with
    ``PUT /v1/blobs/{sha256}``: the store checks it is there); its spec (if sent) registered.

    ``replace`` needs an admin token (:class:`Forbidden`); a blob over the limit is :class:`PayloadTooLarge`
    (refused from its declared or encoded size before decoding); bad base64 is a 422 at ``loc + blob_b64``;
    a spec that does not key to ``graph_key`` is refused by the store (422). Digest and size are
    checked by :meth:`Store.publish_plan`.
    """
    if upload.replace and not principal.may("admin"):
        raise Forbidden(f"token {principal.name!r} has role {principal.role}; replacing a stored plan needs admin")
    limit = settings.max_blob_bytes
    too_large = f"plan blob of %d bytes or more exceeds the limit of {limit} bytes"
    if upload.blob_size > limit:
        raise PayloadTooLarge(too_large % upload.blob_size)
    # before decoding: its base64 is longer than any allowed blob's
    if upload.blob_b64 is not None and len(upload.blob_b64) > base64_size(limit):
        raise PayloadTooLarge(f"plan blob of {len(upload.blob_b64)} base64 characters exceeds the limit of {limit} "
                              f"bytes (at most {base64_size(limit)} characters)")
    try:
        blob = upload.blob_bytes()
    except ValueError as exc:
        raise RequestValidationError([{"loc": (*loc, "blob_b64"), "msg": str(exc), "type": "value_error"}]) from None
    if blob is not None and len(blob) > limit:
        raise PayloadTooLarge(too_large % len(blob))
    if upload.spec is not None:
        store.put_spec(upload.graph_key, upload.spec)
    return blob


def publish_job_plan(store: Store, plan: PlanUpload, blob: bytes | None, *, job_id: int, worker_id: str, lease_token: str,
                     principal: Principal) -> tuple[PlanRecord, bool]:
    """Publish the plan of job ``job_id`` and mark the job succeeded, in one transaction, if the caller holds
    its lease (``worker_id``, ``lease_token``, and ``principal`` the API token that claimed it); the record,
    and whether this was a repeat. The holder repeating a completion that went through (its answer lost)
    gets the stored record; every other refusal (:class:`LeaseLost`, ``NotLeaseHolder`` …) stands."""
    try:
        return store.publish_plan(plan, blob, job_id=job_id, worker_id=worker_id, lease_token=lease_token,
                                  holder=principal.identity, replace=plan.replace), False
    except LeaseLost:
        done = store.get_plan(plan.graph_key, plan.environment)
        if (done is None or done.job_id != job_id or done.blob_sha256 != plan.blob_sha256
                or not store.completed_with(job_id, worker_id, lease_token, holder=principal.identity)):
            raise
        return done, True

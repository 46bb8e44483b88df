"""Plan uploads: the checks before a plan reaches the store, which ``PUT /v1/plans`` (an admin's) and a job's
completion share, and publishing the plan of a held job (the completion's)."""

from __future__ import annotations

from ..errors import Forbidden, LeaseLost, PayloadTooLarge
from ..protocol import PlanRecord, PlanUpload
from ..settings import ServerSettings
from ..store import Store
from .auth import Principal


def accept_upload(upload: PlanUpload, principal: Principal, store: Store, settings: ServerSettings, *,
                  job: tuple[int, str, str] | None = None) -> None:
    """Check a plan upload (its record; the blob was uploaded before with ``PUT /v1/blobs/{sha256}``) and register
    its spec (if sent).

    ``replace`` needs an admin token (:class:`Forbidden`); a ``blob_size`` over ``ServerSettings.max_blob_bytes`` is
    :class:`PayloadTooLarge`; a spec that does not key to ``graph_key`` is refused by the store (422). That the blob
    is stored with ``blob_size`` bytes, and its digest, are checked by :meth:`Store.publish_plan`. ``job``: the
    ``(job_id, worker_id, lease_token)`` the upload completes; with a spec, the caller must hold that lease (or have
    completed the job with it) before the spec is stored (what :func:`~plancache.store.jobs.held_job` raises
    otherwise). Without one, publishing checks the lease, in its own transaction.
    """
    if upload.replace and not principal.may("admin"):
        raise Forbidden(f"token {principal.name!r} has role {principal.role}; replacing a stored plan needs admin")
    limit = settings.max_blob_bytes
    if upload.blob_size > limit:
        raise PayloadTooLarge(f"plan blob of {upload.blob_size} bytes exceeds the limit of {limit} bytes")
    if upload.spec is None:
        return
    if job is not None:
        try:
            store.check_held(*job, holder=principal.identity, completing=True)
        except LeaseLost:  # a completion repeated by its holder (its answer lost) stores its spec again, harmlessly
            if not store.completed_with(*job, holder=principal.identity):
                raise
    store.put_spec(upload.graph_key, upload.spec)


def publish_job_plan(store: Store, plan: PlanUpload, *, job_id: int, worker_id: str, lease_token: str,
                     principal: Principal) -> tuple[PlanRecord, bool]:
    """Publish the plan of job ``job_id`` and mark the job succeeded, in one transaction, if the caller holds
    its lease (``worker_id``, ``lease_token``, and ``principal`` the API token that claimed it); the record,
    and whether this was a repeat. The holder repeating a completion that went through (its answer lost)
    gets the stored record; every other refusal (:class:`LeaseLost`, ``NotLeaseHolder`` …) stands."""
    try:
        return store.publish_plan(plan, None, job_id=job_id, worker_id=worker_id, lease_token=lease_token,
                                  holder=principal.identity, replace=plan.replace), False
    except LeaseLost:
        done = store.get_plan(plan.graph_key, plan.environment)
        if (done is None or done.job_id != job_id or done.blob_sha256 != plan.blob_sha256
                or not store.completed_with(job_id, worker_id, lease_token, holder=principal.identity)):
            raise
        return done, True

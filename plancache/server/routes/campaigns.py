"""Admin: re-tune campaigns — enqueue every known graph key for a new environment (a cuDNN or driver upgrade)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field, model_validator

from ...environment import VALIDITY_FIELDS
from ...protocol import PRIORITY_MAX, TargetEnvironment
from ...store.campaigns import run_campaign
from ...validation import Int, StrictModel
from ..auth import Admin
from ..bodies import CheckedRoute
from ..deps import StoreDep
from ..errors import documented_errors

router = APIRouter(route_class=CheckedRoute, tags=["admin"])


class CampaignRequest(StrictModel):
    # the schema states what _target_names_something checks: at least one validity field set (not null)
    target: TargetEnvironment = Field(description="at least one field set", json_schema_extra={"anyOf": [
        {"required": [f], "properties": {f: {"type": "string" if f == "frontend_version" else "integer"}}}
        for f in VALIDITY_FIELDS]})
    priority: Int = Field(default=0, ge=-PRIORITY_MAX, le=PRIORITY_MAX, description="higher is claimed first")
    max_attempts: Int | None = Field(default=None, ge=1, le=100)

    @model_validator(mode="after")
    def _target_names_something(self) -> CampaignRequest:
        if all(getattr(self.target, f) is None for f in VALIDITY_FIELDS):
            raise ValueError("target sets no field: a campaign for every environment would be finished by whichever "
                             "worker claims each job first; name at least the field that changes (e.g. cudnn_version)")
        return self


class CampaignResponse(BaseModel):
    target: TargetEnvironment
    known_graph_keys: int = Field(description="graph keys whose spec is stored")
    already_planned: int = Field(description="skipped: a plan exists on the target (only when it names every field)")
    enqueued: int = Field(description="new jobs")
    already_queued: int = Field(description="keys that had a queued or running job for this target")


@router.post("/v1/admin/campaigns", response_model=CampaignResponse,
             summary="Enqueue every known graph key for a target environment",
             responses=documented_errors(401, 403, 422, 503))
def create_campaign(req: CampaignRequest, store: StoreDep, _: Admin) -> CampaignResponse:
    """Run before (or during) a fleet upgrade so the new environment's plans are tuned before clients ask.

    Every graph key with a stored spec gets a job on ``target`` (de-duplicated against queued or running
    jobs, so calling again is harmless); with every validity field set, keys already planned there are skipped.
    """
    result = run_campaign(store, req.target, priority=req.priority, max_attempts=req.max_attempts)
    return CampaignResponse(target=req.target, known_graph_keys=result.known, already_planned=result.already_planned,
                            enqueued=result.enqueued, already_queued=result.already_queued)

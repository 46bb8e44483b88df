"""Admin: the autotune policy of this server process — its bounds and last step, and a step run at once."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from ...protocol import JobList
from ..auth import Admin
from ..autotune import Autotuner
from ..bodies import CheckedRoute
from ..deps import SettingsDep, StoreDep
from ..errors import documented_errors

router = APIRouter(route_class=CheckedRoute, tags=["admin"])


class AutotuneStatus(BaseModel):
    enabled: bool = Field(description="PLANCACHE_AUTOTUNE: whether this process runs the policy in the background")
    min_misses: int = Field(description="PLANCACHE_AUTOTUNE_MIN_MISSES: misses of a key on an environment before it "
                                        "is enqueued there")
    jobs_per_hour: int = Field(description="PLANCACHE_AUTOTUNE_JOBS_PER_HOUR: auto jobs per environment and hour")
    worker_window_seconds: float = Field(description="PLANCACHE_AUTOTUNE_WORKER_WINDOW: an environment is served "
                                                     "when a worker claimed for it this recently")
    interval_seconds: float = Field(description="PLANCACHE_AUTOTUNE_INTERVAL: seconds between background steps")
    last_run_at: datetime | None = Field(description="this process's last step (none yet: null)")
    last_enqueued: int = Field(description="jobs its last step created")
    last_error: str | None = Field(description="why its last step failed, if it did")


def _autotuner(request: Request) -> Autotuner:
    tuner: Autotuner = request.app.state.autotuner
    return tuner


@router.get("/v1/admin/autotune", response_model=AutotuneStatus, summary="The autotune policy of this server process",
            responses=documented_errors(401, 403, 503))
def autotune_status(request: Request, settings: SettingsDep, _: Admin) -> AutotuneStatus:
    """The policy's bounds (set by the ``PLANCACHE_AUTOTUNE_*`` settings; docs/DEPLOYMENT.md "Autotune") and
    what this process's last step did."""
    tuner = _autotuner(request)
    return AutotuneStatus(enabled=settings.autotune, min_misses=tuner.policy.min_misses,
                          jobs_per_hour=tuner.policy.jobs_per_hour,
                          worker_window_seconds=tuner.policy.worker_window.total_seconds(),
                          interval_seconds=tuner.interval, last_run_at=tuner.last_run_at,
                          last_enqueued=tuner.last_enqueued, last_error=tuner.last_error)


@router.post("/v1/admin/autotune/run", response_model=JobList, summary="Run one step of the autotune policy now",
             responses=documented_errors(401, 403, 503))
async def autotune_run(request: Request, store: StoreDep, _: Admin) -> JobList:
    """Enqueue now what the policy would at its next step, within the same bounds and budget (also when the
    background policy is off): the jobs it created, per environment most-missed first."""
    return JobList(jobs=await run_in_threadpool(_autotuner(request).step))

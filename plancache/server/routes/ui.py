"""The read-only status page for people (reader role, or open reads): coverage, misses, the queue, gains."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse

from ..auth import Reader
from ..autotune import autotune_policy
from ..bodies import CheckedRoute
from ..deps import StoreDep
from ..errors import documented_errors
from ..status_page import gather, render

router = APIRouter(route_class=CheckedRoute, tags=["status"])


@router.get("/ui", summary="The status page (HTML)", response_class=HTMLResponse,
            responses={200: {"content": {"text/html": {}}, "description": "one HTML page, no script"},
                       # errors stay JSON, whatever the page's own type
                       **{s: {**e, "content": {"application/json": {}}}
                          for s, e in documented_errors(401, 403, 503).items()}})
async def status_page(request: Request, store: StoreDep, _: Reader) -> HTMLResponse:
    """Plan coverage per environment, the most missed graphs and why each has no plan, the queue and recent jobs,
    and per plan the tuned time against the heuristic's. Server-rendered, without script or external resources."""
    status = await run_in_threadpool(gather, store, autotune_policy(request))
    return HTMLResponse(render(status), headers={"Cache-Control": "no-store",
                                                 "Content-Security-Policy": "default-src 'none'; style-src "
                                                                            "'unsafe-inline'; img-src 'self'"})

"""Liveness, readiness (the database answers) and Prometheus metrics; none needs a token."""

from __future__ import annotations

import sqlalchemy.exc
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ... import __version__
from ...http import API_VERSION
from ..bodies import CheckedRoute
from ..bounded import STORE_WAIT
from ..deps import MetricsDep, StoreDep
from ..errors import documented_errors, error_response

router = APIRouter(route_class=CheckedRoute, tags=["health"])


@router.get("/healthz", summary="The process is up")
async def healthz() -> dict[str, str]:
    """Answered on the event loop itself (no worker thread): it measures whether the loop is responsive. Names the
    wire's API version and the server's release."""
    return {"status": "ok", "api_version": API_VERSION, "release": __version__}


@router.get("/readyz", summary="The database answers", responses=documented_errors(503))
def readyz(request: Request, _store: StoreDep) -> JSONResponse:
    """The app's shared ping (``app.state.readiness``): a database that hangs costs each probe
    :data:`~plancache.server.bounded.STORE_WAIT` seconds and the process one blocked thread."""
    try:
        request.app.state.readiness.get()
    except TimeoutError:
        return error_response(503, "database_unavailable", f"the database does not answer within {STORE_WAIT:g} s")
    except sqlalchemy.exc.SQLAlchemyError as exc:
        return error_response(503, "database_unavailable", f"the database does not answer ({type(exc).__name__})")
    return JSONResponse({"status": "ready"})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format"}})
def metrics(m: MetricsDep) -> Response:
    return Response(m.render(), media_type=m.content_type)

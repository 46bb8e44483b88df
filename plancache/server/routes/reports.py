"""What clients report back: the plans they refused (``plancache_client_rejects_total{reason}``)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ...protocol import RejectReport
from ..auth import Reader
from ..bodies import CheckedRoute
from ..deps import MetricsDep
from ..errors import documented_errors

router = APIRouter(route_class=CheckedRoute, tags=["reports"])


@router.post("/v1/reports/rejects", status_code=204, response_class=Response,
             summary="Count the plans a client refused, by reason", responses=documented_errors(401, 403, 422))
async def report_rejects(report: RejectReport, metrics: MetricsDep, _principal: Reader) -> Response:
    """A client's rejects since its last report (an unknown signing key, a digest that does not match, ...): the
    server never sees them otherwise. Labels are the fixed set of reasons."""
    for reason, n in report.rejects.items():
        metrics.client_rejects.labels(reason).inc(n)
    return Response(status_code=204)

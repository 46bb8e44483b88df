"""The API's routers, one module per area; :data:`ROUTERS` is what the app includes."""

from __future__ import annotations

from . import admin, autotune, blobs, campaigns, health, jobs, plans, reports, specs, tokens, ui

ROUTERS = (health.router, specs.router, blobs.router, plans.router, admin.router, autotune.router, campaigns.router,
           jobs.router, reports.router, tokens.router, ui.router)

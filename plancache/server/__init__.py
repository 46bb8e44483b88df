"""The plancache HTTP service (FastAPI): ``create_app(settings, store=...)`` builds one app; ``plancache serve`` runs it."""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]

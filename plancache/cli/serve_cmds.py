"""``plancache serve``: migrate the configured database to head, then serve the HTTP API with uvicorn."""

from __future__ import annotations

import typer


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on"),
    port: int = typer.Option(8787, "--port", min=1, max=65535, help="TCP port"),
) -> None:
    """Serve the plancache API (OpenAPI at /docs). Configuration: PLANCACHE_* environment variables."""
    import uvicorn

    from ..server import create_app
    from ..settings import get_settings
    from .db_cmds import _open

    settings = get_settings()
    with _open(settings.database_url, create=True) as store:
        where = store.db.url.render_as_string(hide_password=True)
        typer.echo(f"{where}: schema at revision {store.db.current_revision()}; serving on http://{host}:{port}", err=True)
        uvicorn.run(create_app(settings, store=store), host=host, port=port, proxy_headers=False)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)

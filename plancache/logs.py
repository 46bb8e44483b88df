"""How the long-running commands (``serve``, ``worker``) log: plain lines, or one JSON object per line
(``PLANCACHE_LOG_FORMAT=json``) for a log pipeline to index without parsing text."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The fields of uvicorn's access log record, in the order of its arguments.
ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, ``exception``
    when there is one, and an access log line's fields (:data:`ACCESS_FIELDS`)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == len(ACCESS_FIELDS):
            out.update(zip(ACCESS_FIELDS, record.args, strict=True))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def uvicorn_log_config(log_format: LogFormat) -> dict[str, Any] | None:
    """uvicorn's ``log_config`` for ``log_format``: None (uvicorn's own) for text; for json every line of uvicorn's
    and plancache's loggers through :class:`JsonFormatter` on stderr."""
    if log_format == "text":
        return None
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": handler},
        "loggers": {name: {"handlers": ["json"], "level": "INFO", "propagate": False}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "plancache")},
    }


def configure(log_format: LogFormat, level: int = logging.INFO) -> None:
    """A handler on stderr for the root logger, in ``log_format`` (a command's, not a library's, choice); nothing
    when the root logger has handlers already (an embedding program's, a test runner's), as ``basicConfig``."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])

"""``PLANCACHE_LOG_FORMAT=json``: every line of ``serve`` (uvicorn's loggers, access lines with their fields) and of
``worker`` is one JSON object; ``text`` keeps uvicorn's own configuration."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from contextlib import redirect_stderr

from plancache import logs
from plancache.settings import ServerSettings, WorkerSettings


def test_serve_logs_one_json_object_per_line_access_fields_included(monkeypatch):
    monkeypatch.setenv("PLANCACHE_LOG_FORMAT", "json")
    config = logs.uvicorn_log_config(ServerSettings().log_format)
    assert config is not None and logs.uvicorn_log_config("text") is None
    err = io.StringIO()
    with redirect_stderr(err):
        logging.config.dictConfig({**config, "handlers": {"json": {**config["handlers"]["json"], "stream": err}}})
        try:
            logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "10.0.0.1:5", "GET", "/healthz", "1.1",
                                                     200)
            try:
                raise ValueError("boom")
            except ValueError:
                logging.getLogger("plancache.server").exception("unhandled error in %s", "GET /x")
        finally:
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "plancache"):
                logger = logging.getLogger(name)
                logger.handlers.clear()
                logger.propagate = True
    access, error = (json.loads(line) for line in err.getvalue().splitlines())
    assert access["logger"] == "uvicorn.access" and access["status"] == 200 and access["path"] == "/healthz"
    assert access["message"] == '10.0.0.1:5 - "GET /healthz HTTP/1.1" 200' and access["time"].endswith("+00:00")
    assert error["level"] == "ERROR" and "ValueError: boom" in error["exception"]


def test_the_worker_logs_json_when_asked(monkeypatch):
    monkeypatch.setenv("PLANCACHE_LOG_FORMAT", "json")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers.clear()  # a worker process starts with none (the test runner has its own)
    try:
        logs.configure(WorkerSettings().log_format)
        (handler,) = root.handlers
        assert isinstance(handler.formatter, logs.JsonFormatter)
        line = handler.format(logging.LogRecord("plancache.worker", logging.INFO, __file__, 1, "job %d done", (7,), None))
        assert json.loads(line)["message"] == "job 7 done"
    finally:
        root.handlers[:], root.level = saved[0], saved[1]

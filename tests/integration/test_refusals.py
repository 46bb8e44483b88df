"""Refused bodies (issue 37, finding 1): nesting is bounded by a loop, a refusal is charged and logged in one line.

Figure (400 POST /v1/specs of a spec with an attribute nested 800 deep from one reader, default budget, on main
4d1a308): all 400 were 500 with a ``RecursionError`` traceback, 72.6 MB of log, none 429; with the
fix: 300 × 422 (the spec budget's burst), then 100 × 429, 36 KB of log (most of it the test client's own lines),
no traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.testclient import TestClient

from plancache.server import create_app
from plancache.server.bodies import MAX_BODY_DEPTH
from plancache.server.errors import CLIENT_LOG_BURST
from plancache.settings import Settings
from tests.server_util import ADMIN_TOKEN, bearer


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


def _client(file_store: Any, **settings: Any) -> TestClient:
    app = create_app(Settings(database_url="sqlite:///unused.db", admin_token=ADMIN_TOKEN, **settings),
                     store=file_store)
    return TestClient(app, raise_server_exceptions=False)


def test_deep_nesting_is_422_charged_and_logged_in_bounded_lines(file_store, make_spec, caplog):
    token, _ = file_store.create_token("flooder", "reader")
    _, spec = make_spec(0)
    spec["nodes"][0]["junk"] = _nested(800)
    caplog.set_level(logging.INFO, logger="plancache.server")
    with _client(file_store, spec_write_burst=5, spec_writes_per_minute=1) as client:
        codes = [client.post("/v1/specs", json=spec, headers=bearer(token)).status_code for _ in range(100)]
        assert codes == [422] * 5 + [429] * 95  # the refused bodies took the spec budget
        answer = client.post("/v1/specs", json=spec, headers=bearer(ADMIN_TOKEN))
    assert answer.status_code == 422 and f"more than {MAX_BODY_DEPTH} deep" in answer.json()["error"]["message"]
    lines = [r for r in caplog.records if r.name == "plancache.server"]
    assert all(r.exc_info is None for r in lines)
    assert 6 <= len(lines) <= CLIENT_LOG_BURST + 1
    assert "token:" in lines[0].getMessage() and "nests too deeply" in lines[0].getMessage()


def test_the_log_of_one_client_is_bounded_and_counts_what_it_left_out(file_store, caplog):
    caplog.set_level(logging.INFO, logger="plancache.server")
    with _client(file_store, open_reads=True) as client:
        for _ in range(3 * CLIENT_LOG_BURST):
            assert client.post("/v1/plans/resolve", json=_nested(MAX_BODY_DEPTH + 1)).status_code == 422
    lines = [r.getMessage() for r in caplog.records if r.name == "plancache.server"]
    assert len(lines) == CLIENT_LOG_BURST and all("address:testclient" in line for line in lines)


def test_nesting_at_the_limit_reaches_validation_and_past_it_is_refused_before(file_store):
    with _client(file_store, open_reads=True) as client:
        at_limit = client.post("/v1/plans/resolve", json={"environment": _nested(MAX_BODY_DEPTH - 1)})
        past = client.post("/v1/plans/resolve", json={"environment": _nested(MAX_BODY_DEPTH)})
    assert at_limit.status_code == 422 and "deep" not in at_limit.json()["error"]["message"]
    assert past.status_code == 422 and f"more than {MAX_BODY_DEPTH} deep" in past.json()["error"]["message"]

"""The role matrix: every route × every kind of caller, on SQLite and Postgres; open reads; tokens kept out of logs."""

from __future__ import annotations

import logging

import pytest

from plancache.server.redact import RedactTokens
from tests.factories import H200
from tests.server_util import ADMIN_TOKEN, api, bearer, open_api  # noqa: F401

KEY = "0" * 64
ENV = H200.validity()

# (method, path template, concrete path, role needed or None)
ROUTES = [
    ("GET", "/healthz", "/healthz", None),
    ("GET", "/readyz", "/readyz", None),
    ("GET", "/metrics", "/metrics", None),
    ("POST", "/v1/specs", "/v1/specs", "reader"),
    ("GET", "/v1/specs/{graph_key}", f"/v1/specs/{KEY}", "reader"),
    ("POST", "/v1/plans/resolve", "/v1/plans/resolve", "reader"),
    ("POST", "/v1/plans/explain", "/v1/plans/explain", "reader"),
    ("POST", "/v1/plans/siblings", "/v1/plans/siblings", "reader"),
    ("POST", "/v1/reports/rejects", "/v1/reports/rejects", "reader"),
    ("GET", "/ui", "/ui", "reader"),
    # the sign-in form takes a token in its body, none in a header (a JSON body is refused with 415)
    ("POST", "/ui/login", "/ui/login", None),
    ("POST", "/ui/logout", "/ui/logout", None),
    ("GET", "/v1/plans/{graph_key}", f"/v1/plans/{KEY}", "reader"),
    ("GET", "/v1/plans/{graph_key}/candidates", f"/v1/plans/{KEY}/candidates", "admin"),
    ("GET", "/v1/blobs/{sha256}", f"/v1/blobs/{KEY}", "reader"),
    ("HEAD", "/v1/blobs/{sha256}", f"/v1/blobs/{KEY}", "reader"),
    # a worker token PUTs only the blob of a job it holds (X-Plancache-Job …; test_blob_uploads.py): without, 403
    ("PUT", "/v1/blobs/{sha256}", f"/v1/blobs/{KEY}", "admin"),
    ("PUT", "/v1/plans", "/v1/plans", "admin"),
    ("POST", "/v1/admin/tune", "/v1/admin/tune", "admin"),
    ("POST", "/v1/admin/tune/misses", "/v1/admin/tune/misses", "admin"),
    ("POST", "/v1/admin/campaigns", "/v1/admin/campaigns", "admin"),
    ("POST", "/v1/admin/withdrawals", "/v1/admin/withdrawals", "admin"),
    ("POST", "/v1/admin/jobs/{job_id}/cancel", "/v1/admin/jobs/1/cancel", "admin"),
    ("GET", "/v1/admin/autotune", "/v1/admin/autotune", "admin"),
    ("GET", "/v1/admin/tokens", "/v1/admin/tokens", "admin"),
    ("POST", "/v1/admin/tokens", "/v1/admin/tokens", "admin"),
    ("POST", "/v1/admin/tokens/{token_id}/revoke", "/v1/admin/tokens/1/revoke", "admin"),
    ("POST", "/v1/admin/autotune/run", "/v1/admin/autotune/run", "admin"),
    ("GET", "/v1/misses", "/v1/misses", "admin"),
    ("GET", "/v1/jobs", "/v1/jobs", "admin"),
    ("GET", "/v1/jobs/{job_id}", "/v1/jobs/1", "worker"),
    ("POST", "/v1/jobs/claim", "/v1/jobs/claim", "worker"),
    ("POST", "/v1/jobs/{job_id}/heartbeat", "/v1/jobs/1/heartbeat", "worker"),
    ("POST", "/v1/jobs/{job_id}/complete", "/v1/jobs/1/complete", "worker"),
    ("POST", "/v1/jobs/{job_id}/fail", "/v1/jobs/1/fail", "worker"),
]
RANK = {None: -1, "reader": 0, "worker": 1, "admin": 2}


def _call(api, method, path, headers):
    params = ENV if path.startswith("/v1/plans/") and method == "GET" else None
    body = {} if method in ("POST", "PUT") else None
    return api.client.request(method, path, params=params, json=body, headers=headers)


def test_the_matrix_covers_every_route(api):
    served = {(m.upper(), path) for path, ops in api.app.openapi()["paths"].items() for m in ops}
    assert served == {(m, t) for m, t, _, _ in ROUTES}


def test_role_matrix(api):
    revoked, _ = api.store.create_token("gone", "admin")
    api.store.revoke_token("gone")
    callers = {
        "no token": ({}, None),
        "unknown token": (bearer("pct_not-a-real-token"), None),
        "revoked admin token": (bearer(revoked), None),
        "not a bearer header": ({"Authorization": f"Basic {ADMIN_TOKEN}"}, None),
        "empty bearer": ({"Authorization": "Bearer "}, None),
        "reader": (api.reader, "reader"),
        "worker": (api.worker, "worker"),
        "admin": (api.admin, "admin"),
        "bootstrap admin": (bearer(ADMIN_TOKEN), "admin"),
    }
    for method, _, path, needed in ROUTES:
        for caller, (headers, role) in callers.items():
            r = _call(api, method, path, headers)
            allowed = needed is None or RANK[role] >= RANK[needed]
            expected = "allowed" if allowed else (401 if role is None else 403)
            got = "allowed" if r.status_code not in (401, 403) else r.status_code
            assert got == expected, (method, path, caller, r.status_code, r.text)
            if got != "allowed" and method != "HEAD":  # a HEAD answer has no body
                assert r.json()["error"]["code"] == ("unauthorized" if got == 401 else "forbidden")
                if got == 401:
                    assert r.headers["www-authenticate"] == "Bearer"


def test_open_reads_admit_anonymous_readers_only(store):
    with open_api(store, open_reads=True) as api:
        for method, _, path, needed in ROUTES:
            r = _call(api, method, path, {})
            anonymous_ok = needed is None or (needed == "reader" and (method, path) != ("POST", "/v1/specs"))
            assert (r.status_code == 401) == (not anonymous_ok), (method, path, r.status_code)
        # a token that is sent must still be valid
        assert _call(api, "POST", "/v1/plans/resolve", bearer("pct_wrong")).status_code == 401


def test_without_an_admin_token_setting_there_is_no_bootstrap_admin(store):
    with open_api(store, admin_token=None) as api:
        assert api.client.get("/v1/jobs", headers=bearer(ADMIN_TOKEN)).status_code == 401
        assert api.client.get("/v1/jobs", headers=api.admin).status_code == 200


def test_tokens_never_reach_the_logs(api, caplog):
    caplog.set_level(logging.DEBUG)
    secret = api.worker["Authorization"].split()[1]
    for headers in (api.worker, bearer(ADMIN_TOKEN), bearer("pct_wrong-token"), api.reader):
        for method, _, path, _ in ROUTES:
            _call(api, method, path, headers)
    text = caplog.text
    assert secret not in text and ADMIN_TOKEN not in text and "pct_wrong-token" not in text


def test_redaction_filter_masks_access_log_arguments():
    filt = RedactTokens(("s3cret-admin",))
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/jobs?token=pct_abc-DEF_1&x=s3cret-admin", "1.1", 200), None)
    assert filt.filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "GET /v1/jobs?token=[redacted]&x=[redacted] HTTP/1.1" 200'
    record = logging.LogRecord("plancache.server", logging.INFO, __file__, 1, "header Authorization: Bearer abc.def", (), None)
    filt.filter(record)
    assert record.getMessage() == "header Authorization: Bearer [redacted]"


@pytest.mark.parametrize("header", ["Bearer", "Token abc", "bearer  "])
def test_malformed_authorization_is_401(api, header):
    r = api.client.get("/v1/jobs", headers={"Authorization": header})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("padded", [ADMIN_TOKEN + "\n", " " + ADMIN_TOKEN, ADMIN_TOKEN + " ", "ädmin-" + ADMIN_TOKEN])
def test_an_admin_token_no_header_can_carry_is_refused_at_start(store, padded):
    """A bootstrap admin token with a newline (a secret file's), a space at either end or a non-ASCII character
    can never be presented in an Authorization header: refused as a setting, not a server whose admin is 401."""
    from pydantic import ValidationError

    from plancache.settings import Settings

    with pytest.raises(ValidationError, match="HTTP header"), open_api(store, admin_token=padded) as api:
        r = api.client.get("/v1/jobs", headers={"Authorization": f"Bearer {padded}".encode()})
        assert r.status_code == 200, r.text  # what a server taking the setting answers: 401
    Settings(admin_token="inner space " + ADMIN_TOKEN)  # a space inside travels

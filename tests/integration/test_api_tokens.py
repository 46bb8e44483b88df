"""``/v1/admin/tokens``: an admin creates, lists and revokes API tokens over HTTP; the secret is in the creation's
answer only, an expiry is kept, a non-admin is refused."""

from __future__ import annotations

from tests.server_util import api, bearer, open_api  # noqa: F401


def test_an_admin_creates_lists_and_revokes_tokens_over_http(store):
    with open_api(store, token_cache_seconds=0) as a:
        created = a.client.post("/v1/admin/tokens", json={"name": "ci", "role": "reader", "expires_in_seconds": 3600},
                                headers=a.admin)
        assert created.status_code == 201, created.text
        body = created.json()
        token, info = body["token"], body["info"]
        assert token.startswith("pct_") and info["role"] == "reader" and info["expires_at"] is not None
        assert a.client.get("/v1/specs/" + "0" * 64, headers=bearer(token)).status_code == 404  # it authenticates
        listed = a.client.get("/v1/admin/tokens", headers=a.admin).json()["tokens"]
        assert [t for t in listed if t["id"] == info["id"]] == [info] and all("token" not in t for t in listed)
        again = a.client.post("/v1/admin/tokens", json={"name": "ci", "role": "reader"}, headers=a.admin)
        assert again.status_code == 409
        revoked = a.client.post(f"/v1/admin/tokens/{info['id']}/revoke", headers=a.admin)
        assert revoked.status_code == 200 and revoked.json()["revoked"] is True
        assert a.client.get("/v1/specs/" + "0" * 64, headers=bearer(token)).status_code == 401
        assert a.client.post("/v1/admin/tokens/999999/revoke", headers=a.admin).status_code == 404
        refused = [a.client.post("/v1/admin/tokens", json=body, headers=a.admin).status_code for body in (
            {"name": "x", "role": "root"}, {"name": "", "role": "reader"}, {"name": "x", "role": "reader",
                                                                          "expires_in_seconds": 0},
            {"name": "x", "role": "reader", "secret": "mine"})]
        assert refused == [422] * 4
        for who in (a.reader, a.worker):
            assert a.client.get("/v1/admin/tokens", headers=who).status_code == 403
            assert a.client.post("/v1/admin/tokens", json={"name": "y", "role": "admin"}, headers=who).status_code == 403

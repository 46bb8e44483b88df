"""Withdrawn plans in the store and on the server (both databases): a signed withdrawal deletes the plan's record,
resolve stops serving it, explain says ``withdrawn`` and carries the signed withdrawal; only a plan of a higher
revision takes its place; ``POST /v1/admin/withdrawals`` and ``plancache plans withdraw``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from plancache import errors
from plancache.cli import make_app
from plancache.protocol import Withdrawal
from plancache.signing import Signer, TrustedKeys, keygen
from tests.factories import make_meta, new_signer, stored_plans, trusted
from tests.server_util import api  # noqa: F401


@pytest.fixture
def signer():
    return new_signer()


@pytest.fixture
def planned(store, make_spec, gpu_env, signer):
    """A signed plan stored for one key on ``gpu_env``: ``(key, its record)``."""
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    blob = b"the plan that turned out wrong" * 10
    return key, store.publish_plan(make_meta(key, gpu_env, blob, signer), blob)


def withdrawal_of(record, signer, reason="wrong results on sm_90 with this driver") -> Withdrawal:
    return signer.sign_withdrawal(Withdrawal(graph_key=record.graph_key, environment=record.environment,
                                             blob_sha256=record.blob_sha256, withdrawn_revision=record.revision,
                                             reason=reason))


def test_a_withdrawn_plan_is_never_served_and_explained_as_withdrawn(store, planned, gpu_env, signer):
    key, record = planned
    w = withdrawal_of(record, signer)
    assert w.revision > record.revision
    trusted(signer).verify_withdrawal(w, what="withdrawal")  # signed like a plan
    stored = store.withdraw_plan(w)
    assert stored.revision == w.revision and stored.env_id == gpu_env.env_id and stored.envelope == w.envelope
    assert store.get_plan(key, gpu_env) is None
    assert stored_plans(store, gpu_env, [key]) == ({}, [key])
    reason = store.explain_misses(gpu_env, [key])[key]
    assert reason.reason == "withdrawn" and "wrong results on sm_90" in reason.message
    assert f"revision {record.revision}" in reason.message
    assert reason.withdrawal is not None and reason.withdrawal.envelope == w.envelope
    trusted(signer).verify_withdrawal(reason.withdrawal, what="withdrawal")
    assert store.withdraw_plan(w) == stored  # sent again: unchanged
    assert store.get_withdrawals(gpu_env, [key, "e" * 64]) == {key: stored}


def test_a_withdrawn_plan_comes_back_only_with_a_higher_revision(store, planned, gpu_env, signer):
    key, record = planned
    w = store.withdraw_plan(withdrawal_of(record, signer))
    blob = b"the plan that turned out wrong" * 10
    old = make_meta(key, gpu_env, blob, revision=record.revision, envelope=record.envelope)
    with pytest.raises(errors.StaleRevision, match=f"withdrawn at revision {w.revision}"):
        store.publish_plan(old, blob)  # re-uploading the withdrawn plan (an old bundle, a retry) does not revive it
    with pytest.raises(errors.StaleRevision):
        store.publish_plan(old, blob, replace=True)
    fixed = make_meta(key, gpu_env, b"the re-tuned plan" * 10, signer)
    assert fixed.revision > w.revision
    assert store.publish_plan(fixed, b"the re-tuned plan" * 10).revision == fixed.revision
    assert store.get_withdrawals(gpu_env, [key]) == {}
    assert store.explain_misses(gpu_env, [key])[key].reason == "planned"


def test_a_withdrawal_must_name_the_stored_plan_and_be_newer(store, planned, gpu_env, signer, make_spec):
    key, record = planned
    unsigned = withdrawal_of(record, signer).model_copy(update={"envelope": None})
    with pytest.raises(errors.SignatureError, match="unsigned"):
        store.withdraw_plan(unsigned)
    with pytest.raises(errors.StaleRevision, match="not the withdrawn revision"):  # replaced meanwhile
        store.withdraw_plan(signer.sign_withdrawal(withdrawal_of(record, signer).model_copy(
            update={"withdrawn_revision": record.revision - 1})))
    older = withdrawal_of(record, signer).model_copy(update={"revision": record.revision})
    with pytest.raises(errors.StaleRevision, match="needs a higher revision"):
        store.withdraw_plan(older)
    other_key, spec = make_spec(1)
    store.put_spec(other_key, spec)
    with pytest.raises(errors.NotFound, match="no plan is stored"):
        store.withdraw_plan(withdrawal_of(record, signer).model_copy(update={"graph_key": other_key}))
    assert store.get_plan(key, gpu_env) == record  # nothing changed
    first = store.withdraw_plan(withdrawal_of(record, signer, "first reason"))
    again = store.withdraw_plan(withdrawal_of(record, signer, "signed again, clearer reason"))
    assert again.revision > first.revision and again.reason == "signed again, clearer reason"
    with pytest.raises(errors.StaleRevision):
        store.withdraw_plan(first)  # an older withdrawal does not replace a newer one


def test_the_admin_route(api, planned, gpu_env, signer):  # noqa: F811
    key, record = planned
    body = withdrawal_of(record, signer).model_dump(mode="json")
    api.app.state.trusted_keys = trusted(signer)  # PLANCACHE_TRUSTED_KEYS naming the signer's public key
    assert api.client.post("/v1/admin/withdrawals", json=body, headers=api.worker).status_code == 403
    r = api.client.post("/v1/admin/withdrawals", json=body, headers=api.admin)
    assert r.status_code == 201, r.text
    assert r.json()["revision"] == body["revision"] and r.json()["env_id"] == gpu_env.env_id
    assert api.client.post("/v1/admin/withdrawals", json=body, headers=api.admin).status_code == 200
    r = api.client.post("/v1/plans/resolve", json={"environment": gpu_env.model_dump(), "graph_keys": [key]},
                        headers=api.reader)
    answer = r.json()
    assert answer["plans"] == {} and answer["missing"] == [key]
    assert answer["reasons"][key]["reason"] == "withdrawn"  # with the withdrawal, as explain gives it
    assert answer["reasons"][key]["withdrawal"]["envelope"] == body["envelope"]
    r = api.client.post("/v1/plans/explain", json={"environment": gpu_env.model_dump(), "graph_keys": [key]},
                        headers=api.reader)
    assert r.json()["reasons"][key]["reason"] == "withdrawn"
    assert r.json()["reasons"][key]["withdrawal"]["envelope"] == body["envelope"]
    unsigned = {**body, "envelope": None, "revision": body["revision"] + 1}
    r = api.client.post("/v1/admin/withdrawals", json=unsigned, headers=api.admin)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
    assert "envelope" in r.json()["error"]["message"]
    stale = signer.sign_withdrawal(Withdrawal(graph_key=key, environment=gpu_env, blob_sha256=record.blob_sha256,
                                              withdrawn_revision=record.revision - 1, reason="older")
                                   ).model_dump(mode="json")
    r = api.client.post("/v1/admin/withdrawals", json=stale, headers=api.admin)
    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_revision"


def test_plans_withdraw_command(store, db_url, planned, gpu_env, tmp_path):
    key, record = planned
    private, _, key_id = keygen(tmp_path / "keys", "admin")
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(make_app(), ["plans", "withdraw", *args, "--database-url", db_url])

    result = run(key, "--environment", gpu_env.env_id[:10], "--reason", "wrong numerics", "--signing-key",
                 str(private))
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert f"withdrew the plan of {key[:16]} on environment {gpu_env.env_id[:12]} (revision {record.revision})" \
        in result.stdout
    stored = store.get_withdrawals(gpu_env, [key])[key]
    assert stored.reason == "wrong numerics" and stored.withdrawn_revision == record.revision
    trusted(Signer.from_file(private)).verify_withdrawal(stored, what="withdrawal")
    assert stored.envelope.signatures[0].keyid == key_id
    assert store.get_plan(key, gpu_env) is None

    again = run(key, "--environment", gpu_env.model_dump_json(), "--reason", "x", "--signing-key", str(private))
    assert again.exit_code == 1 and "no plan is stored" in again.stderr and "hint:" in again.stderr
    bad = run("abc", "--environment", gpu_env.env_id, "--reason", "x", "--signing-key", str(private))
    assert bad.exit_code == 2 and "graph key" in bad.stderr
    nokey = run(key, "--environment", gpu_env.env_id, "--reason", "x")
    assert nokey.exit_code == 3 and "PLANCACHE_SIGNING_KEY" in nokey.stderr


def test_a_bundle_made_before_the_withdrawal_does_not_bring_the_plan_back(store, planned, gpu_env, signer, tmp_path):
    from plancache.bundle import export_bundle, import_bundle

    key, record = planned
    out = tmp_path / "before.bundle"
    assert export_bundle(store, gpu_env, [key], out, signer) == 1
    store.withdraw_plan(withdrawal_of(record, signer))
    report = import_bundle(store, out, trusted(signer))
    assert (report.imported, report.older) == (0, 1)
    assert store.get_plan(key, gpu_env) is None and store.explain_misses(gpu_env, [key])[key].reason == "withdrawn"


def test_the_admin_route_stores_only_withdrawals_its_trusted_keys_verify(api, planned, gpu_env, signer,  # noqa: F811
                                                                         tmp_path):
    """Issue 37, finding 6: on main 4d1a308 a withdrawal signed by any key was stored (201) and cold hosts lost the
    plan although no client accepts the withdrawal; it is 400, and the plan is still served."""
    key, record = planned
    forged = withdrawal_of(record, new_signer()).model_dump(mode="json")
    r = api.client.post("/v1/admin/withdrawals", json=forged, headers=api.admin)
    assert r.status_code == 400 and "PLANCACHE_TRUSTED_KEYS" in r.json()["error"]["message"]  # the server has none
    _, public, _ = keygen(tmp_path / "keys", "admin")
    api.app.state.trusted_keys = TrustedKeys.from_setting(str(public))  # as PLANCACHE_TRUSTED_KEYS makes them
    r = api.client.post("/v1/admin/withdrawals", json=forged, headers=api.admin)
    assert r.status_code == 400 and "unknown_signer" in r.json()["error"]["message"], r.text
    api.app.state.trusted_keys = trusted(signer)
    lying = {**withdrawal_of(record, signer).model_dump(mode="json"), "reason": "not the reason signed"}
    r = api.client.post("/v1/admin/withdrawals", json=lying, headers=api.admin)
    assert r.status_code == 400 and "bad_signature" in r.json()["error"]["message"], r.text
    assert api.store.get_plan(key, gpu_env) is not None
    assert api.store.get_withdrawals(gpu_env, [key]) == {}

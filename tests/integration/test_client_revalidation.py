"""Bounded staleness of the client's disk cache against a real local server: a plan replaced or withdrawn on the
server reaches warm hosts within ``PLANCACHE_REVALIDATE_SECONDS``, asked about in the background (no request on the
load's path); a forged, unsigned or older withdrawal is ignored."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from plancache.errors import PlanMiss
from plancache.protocol import Withdrawal
from plancache.settings import Settings
from tests.factories import H200, OTHER_GPU, make_meta, new_signer
from tests.integration.test_client_ladder import CONV, SDPA, Wire, blob_path, client, seed, signer, srv, wire  # noqa: F401

KEY = CONV.graph_key


def withdrawal_of(record, signer, **overrides) -> Withdrawal:
    return signer.sign_withdrawal(Withdrawal(graph_key=record.graph_key, environment=record.environment,
                                             blob_sha256=record.blob_sha256, withdrawn_revision=record.revision,
                                             reason=overrides.pop("reason", "wrong results"), **overrides))


def warm_up(srv, tmp_path, signer) -> None:
    """A first process fetches the plan of CONV from the server into the disk cache."""
    with client(srv, tmp_path, signer) as cold:
        assert cold.plan(CONV).source == "server"


def checked_file(tmp_path):
    return tmp_path / "cache" / H200.env_id / f"{KEY}.checked"


def age(tmp_path, seconds: float) -> None:
    """The server last confirmed the disk entry of CONV ``seconds`` ago."""
    then = time.time() - seconds
    os.utime(checked_file(tmp_path), (then, then))


def every(seconds: float) -> Settings:
    return Settings(revalidate_seconds=seconds)


def test_a_replaced_plan_reaches_a_warm_host(srv, tmp_path, signer, wire):  # noqa: F811
    """The regression: an admin replaced a plan; a host whose disk cache held the old one loaded it in every
    process (before: always). Now the first process after the bound loads the old one and replaces the entry in the
    background; the next process loads the new one, and the old one is refused from then on."""
    old_blob = seed(srv, CONV, signer)
    warm_up(srv, tmp_path, signer)
    new_blob = b"the re-tuned plan" * 40
    new = srv.store.publish_plan(make_meta(KEY, H200, new_blob, signer), new_blob, replace=True)
    age(tmp_path, 61)
    with client(srv, tmp_path, signer, wire=wire, settings=every(60)) as first:
        assert first.plan(CONV).source == "disk" and first._backend.deserialized == [old_blob]  # keeps it
    assert first.stats().revalidations == {"replaced": 1}
    assert wire.paths == {"/v1/plans/resolve": 1, f"/v1/blobs/{new.blob_sha256}": 1}
    with client(srv, tmp_path, signer, settings=every(60)) as second:
        assert second.plan(CONV).source == "disk" and second._backend.deserialized == [new_blob]
        assert second.disk.revision(KEY) == new.revision
    assert second.stats().revalidations == {}  # confirmed just now: within the bound


def test_revalidation_adds_no_request_to_start_up(srv, tmp_path, signer, wire):  # noqa: F811
    seed(srv, CONV, signer)
    warm_up(srv, tmp_path, signer)
    with client(srv, tmp_path, signer, wire=wire, settings=every(3600)) as within:
        assert within.plan(CONV).source == "disk"
    assert wire.paths == {} and within.stats().revalidations == {}  # within the bound: no request at all

    age(tmp_path, 3601)
    srv.delay = 1.0  # every request takes a second
    with client(srv, tmp_path, signer, wire=wire, settings=every(3600)) as past:
        t0 = time.perf_counter()
        assert past.plan(CONV).source == "disk"
        assert time.perf_counter() - t0 < 0.5  # the load did not wait for the server
        past.context.revalidator.join(5)  # (a close gives a revalidation under way a second)
    assert wire.paths == {"/v1/plans/resolve": 1} and past.stats().revalidations == {"current": 1}
    assert time.time() - checked_file(tmp_path).stat().st_mtime < 60  # confirmed
    srv.delay = 0.0
    with client(srv, tmp_path, signer, wire=wire, settings=every(3600)) as again:
        assert again.plan(CONV).source == "disk"
    assert wire.paths == {"/v1/plans/resolve": 1}


def test_a_withdrawn_plan_leaves_warm_hosts(srv, tmp_path, signer, wire):  # noqa: F811
    old_blob = seed(srv, CONV, signer)
    warm_up(srv, tmp_path, signer)
    record = srv.store.get_plan(KEY, H200)
    w = srv.store.withdraw_plan(withdrawal_of(record, signer))
    with client(srv, tmp_path, signer, wire=wire, settings=every(0)) as warm:
        assert warm.plan(CONV).source == "disk"  # this process keeps the plan it loaded
    assert warm.stats().revalidations == {"withdrawn": 1} and warm.stats().withdrawals == {"applied": 1}
    assert wire.paths == {"/v1/plans/resolve": 1}  # the withdrawal comes with the resolve answer's reason
    folder = tmp_path / "cache" / H200.env_id
    assert not (folder / f"{KEY}.json").exists() and not blob_path(folder, record.blob_sha256).exists()
    assert warm.disk.revision(KEY) == w.revision

    with client(srv, tmp_path, signer) as later:
        assert later.plan(CONV).source == "heuristic" and later._backend.deserialized == []
    assert later.stats().miss_reasons == {"withdrawn": 1} and later.stats().withdrawals == {"not_newer": 1}
    with client(srv, tmp_path / "strict", signer, mode="strict") as strict, \
            pytest.raises(PlanMiss, match="was withdrawn by an admin .*: wrong results"):
        strict.plan(CONV)
    assert strict.disk.revision(KEY) == w.revision  # a host that never had it learns the floor too

    (folder / f"{KEY}.json").write_text(record.model_dump_json())  # the withdrawn plan put back on disk
    blob_path(folder, record.blob_sha256).write_bytes(old_blob)
    with client(None, tmp_path, signer) as offline:
        assert offline.plan(CONV).source == "heuristic" and offline.stats().rejects == {"revision": 1}


class Hostile(Wire):
    """A link that turns the resolve answer for CONV into a miss and puts ``withdrawal`` in the explain answer."""

    def __init__(self, withdrawal: dict) -> None:
        super().__init__()
        self.withdrawal = withdrawal
        self.edit_answer = self._drop

    @staticmethod
    def _drop(body: dict) -> None:
        body["plans"].pop(KEY, None)
        body["missing"] = [KEY]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = super().handle_request(request)
        if request.url.path != "/v1/plans/explain":
            return resp
        body = json.loads(resp.read())
        body["reasons"][KEY] = {"reason": "withdrawn", "message": "withdrawn", "withdrawal": self.withdrawal}
        return httpx.Response(200, json=body)


def _forged(case: str, record, signer) -> dict:
    if case == "unsigned":
        return withdrawal_of(record, signer).model_copy(update={"envelope": None}).model_dump(mode="json")
    if case == "unknown_signer":
        return withdrawal_of(record, new_signer()).model_dump(mode="json")
    if case == "bad_signature":  # the reason changed on the way
        return {**withdrawal_of(record, signer).model_dump(mode="json"), "reason": "another reason"}
    if case == "graph_key":  # a valid withdrawal of another graph's plan
        return withdrawal_of(record.model_copy(update={"graph_key": SDPA.graph_key}), signer).model_dump(mode="json")
    assert case == "environment"
    return withdrawal_of(record.model_copy(update={"environment": OTHER_GPU}), signer).model_dump(mode="json")


@pytest.mark.parametrize("case", ["unsigned", "unknown_signer", "bad_signature", "graph_key", "environment"])
def test_a_forged_or_unsigned_withdrawal_is_ignored(srv, tmp_path, signer, case):  # noqa: F811
    blob = seed(srv, CONV, signer)
    warm_up(srv, tmp_path, signer)
    record = srv.store.get_plan(KEY, H200)
    with client(srv, tmp_path, signer, wire=Hostile(_forged(case, record, signer)), settings=every(0)) as warm:
        assert warm.plan(CONV).source == "disk"
    assert warm.stats().withdrawals == {case: 1} and warm.stats().revalidations == {"kept": 1}
    with client(None, tmp_path, signer) as next_process:
        assert next_process.plan(CONV).source == "disk" and next_process._backend.deserialized == [blob]
    assert next_process.disk.revision(KEY) == record.revision


def test_an_older_withdrawal_is_ignored(srv, tmp_path, signer):  # noqa: F811
    """A withdrawal replayed after the plan was re-tuned (a newer revision) does not remove the newer plan."""
    seed(srv, CONV, signer)
    old = withdrawal_of(srv.store.get_plan(KEY, H200), signer)
    srv.store.withdraw_plan(old)
    fixed_blob = b"the fixed plan" * 40
    srv.store.publish_plan(make_meta(KEY, H200, fixed_blob, signer), fixed_blob)  # revision above the withdrawal's
    warm_up(srv, tmp_path, signer)
    hostile = Hostile(old.model_dump(mode="json"))
    with client(srv, tmp_path, signer, wire=hostile, settings=every(0)) as warm:
        assert warm.plan(CONV).source == "disk"
    assert warm.stats().withdrawals == {"not_newer": 1} and warm.stats().revalidations == {"kept": 1}
    with client(None, tmp_path, signer) as next_process:
        assert next_process._backend.deserialized == [] and next_process.plan(CONV).source == "disk"
        assert next_process._backend.deserialized == [fixed_blob]


def test_a_server_that_does_not_answer_leaves_the_entry_to_the_next_process(srv, tmp_path, signer, wire):  # noqa: F811
    seed(srv, CONV, signer)
    warm_up(srv, tmp_path, signer)
    before = checked_file(tmp_path).stat().st_mtime
    age(tmp_path, 10)
    srv.stop()
    with client(srv, tmp_path, signer, wire=wire, settings=every(5)) as warm:
        assert warm.plan(CONV).source == "disk"
    assert warm.stats().revalidations == {"failed": 1}
    assert checked_file(tmp_path).stat().st_mtime < before  # still unconfirmed: the next process asks again


def test_a_bad_bound_is_refused(tmp_path, signer):  # noqa: F811
    with pytest.raises(ValueError, match="revalidate_seconds must be >= 0"):
        client(None, tmp_path, signer, revalidate_seconds=-1)


def test_a_blob_admitted_before_a_withdrawal_is_not_loaded_after_it(srv, tmp_path, signer):  # noqa: F811
    """A blob admitted but not loaded (a warm start's, or one kept for the callers' own graphs) was loaded into the
    next graph without a check after this very process applied a withdrawal of it; now it is refused, by the
    withdrawal and, should the floor come from elsewhere, by its revision, and the graph gets a local build."""
    seed(srv, CONV, signer)
    warm_up(srv, tmp_path, signer)
    record = srv.store.get_plan(KEY, H200)
    srv.store.withdraw_plan(withdrawal_of(record, signer))
    with client(srv, tmp_path, signer, settings=every(0)) as pc:
        assert pc.warm([CONV]) == [KEY] and pc._backend.deserialized == []  # kept, not loaded
        pc.context.revalidator.join(10)
        assert pc.stats().withdrawals == {"applied": 1} and KEY not in pc.context.verified
        assert pc.plan(CONV).source == "heuristic" and pc._backend.deserialized == []
    seed(srv, SDPA, signer)
    with client(srv, tmp_path / "hook", signer) as hook:
        assert hook.serve(object(), SDPA).source == "server"  # a caller's graph: its blob is kept for the next one
        sdpa = srv.store.get_plan(SDPA.graph_key, H200)
        hook.disk.accept_revision(SDPA.graph_key, sdpa.revision + 1, background=False)  # raised by another process
        assert hook.serve(object(), SDPA) is None  # refused (revision): the caller's FE builds it
        # refused held, then on disk and from the server: all three are the older revision
        assert hook.stats().rejects == {"revision": 3} and SDPA.graph_key not in hook.context.verified
        assert len(hook._backend.deserialized) == 1


def test_a_stalled_revalidation_neither_holds_the_exit_nor_opens_the_breaker(srv, tmp_path, signer):  # noqa: F811
    """With the server stalled, a warm process's close waited the whole request deadline for its background
    revalidation (5 s), and the timed-out revalidation opened the circuit breaker for 30 s, so the process's next
    miss did not ask the server (main 4d1a308). The close gives it a second, then abandons it (the next process
    asks again); a background request that fails does not open the breaker."""
    seed(srv, CONV, signer)
    seed(srv, SDPA, signer)
    warm_up(srv, tmp_path, signer)
    age(tmp_path, 61)
    srv.delay = 3.0
    with client(srv, tmp_path, signer, settings=every(60)) as stalled:
        assert stalled.plan(CONV).source == "disk"
        time.sleep(0.2)  # the revalidation's request is out
        started = time.monotonic()
    closed = time.monotonic() - started
    print(f"close with the server stalled: {closed:.2f} s")
    assert closed < 2.0
    with client(srv, tmp_path, signer, settings=Settings(revalidate_seconds=60, request_deadline=1.0)) as pc:
        assert pc.plan(CONV).source == "disk"
        pc.context.revalidator.join(5)  # the revalidation timed out after its 1 s deadline
        assert pc.stats().revalidations == {"failed": 1}
        srv.delay = 0.0
        assert pc.plan(SDPA).source == "server"  # the breaker stayed closed

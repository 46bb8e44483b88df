"""The client's whole fallback ladder without a network: the server step reads a
:class:`~plancache.client.records.MemoryRecords`, the GPU is :class:`RecordingBackend`. Good plans load from the
records, memory and disk; a bad blob is rejected with its reason and never deserialized; a miss says why, costs at
most two round trips, and registers its spec once. tests/integration/test_client_ladder.py runs the parts that
need the wire (timeouts, size limits, the breaker, a hostile link) against a live server."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from plancache.blobs.base import chunks
from plancache.client import LADDER, MODES, Builds, ClientConfig, Pending, Plan, PlanCache, Step
from plancache.client.records import REGISTERED, UNREGISTERED, MemoryRecords
from plancache.client.remote import MISS_RECHECK_SECONDS, REGISTER_ATTEMPTS
from plancache.client.server_step import ServerStep
from plancache.client.steps import family_key
from plancache.errors import Forbidden, PlanMiss, RequestTimeout, ServerUnavailable, SpecError
from plancache.protocol import MissReason
from plancache.spec import contiguous_strides
from tests.client_fakes import RecordingBackend
from tests.factories import H200, make_record, new_signer, trusted
from tests.integration.test_client_ladder import CONV, MATMUL, SDPA, SPECS, blob_of, blob_path


@pytest.fixture(scope="module")
def signer():
    return new_signer()


@pytest.fixture
def records():
    return MemoryRecords()


def publish(records: MemoryRecords, spec: Any, signer: Any, blob: bytes | None = None, **overrides: Any) -> bytes:
    """A plan for ``spec`` served by ``records`` (its spec registered)."""
    blob = blob if blob is not None else blob_of(spec)
    records.specs[spec.graph_key] = spec
    records.publish(make_record(spec.graph_key, H200, blob, signer, **overrides), blob)
    return blob


def client(records: MemoryRecords | None, tmp_path: Path, signer: Any, *, backend: RecordingBackend | None = None,
           **kw: Any) -> PlanCache:
    kw.setdefault("trusted_keys", trusted(signer))
    return PlanCache("", records=records, backend=backend or RecordingBackend(), cache_dir=tmp_path / "cache", **kw)


def round_trips(records: MemoryRecords) -> int:
    return sum(records.calls.values())


def a_minute_on(pc: PlanCache) -> None:
    """As it is a minute on for ``pc``: its miss memory is past."""
    (step,) = [s for s in pc.steps if isinstance(s, ServerStep)]
    step.missed.expire(time.monotonic() + MISS_RECHECK_SECONDS)


# ------------------------------------------------------------------ loads


def test_a_fresh_process_loads_from_the_records_then_memory_then_disk_offline(records, tmp_path, signer):
    blob = publish(records, CONV, signer)
    with client(records, tmp_path, signer) as pc:
        plan = pc.plan(CONV)
        assert plan.source == "server" and plan.engine_id == 7 and plan.knobs == {"TILE_M": 2}
        assert pc._backend.deserialized == [blob]
        assert pc.plan(CONV.to_json()) is plan  # any spec form; memory
        s = pc.stats()
        assert s.hits == {"server": 1, "memory": 1} and s.rejects == {} and s.misses == 0
        assert s.load_seconds > 0 and s.deserialize_seconds > 0
    assert records.calls == {"resolve": 1}
    offline = client(None, tmp_path, signer)  # no server at all: the disk cache, its entry verified again
    plan = offline.plan(CONV)
    assert plan.source == "disk" and offline._backend.deserialized == [blob]
    assert offline.stats().hits == {"disk": 1} and offline.stats().remote_errors == 0


def test_a_blob_left_out_of_the_answer_is_fetched_by_its_digest(tmp_path, signer):
    records = MemoryRecords(inline=False)
    blob = publish(records, CONV, signer)
    pc = client(records, tmp_path, signer)
    assert pc.plan(CONV).source == "server" and pc._backend.deserialized == [blob]
    assert records.calls == {"resolve": 1, "blob": 1} and pc.stats().blob_sources == {"server": 1}


@pytest.mark.parametrize(("damage", "reason"), [(lambda b: b[:-1], "size"), (lambda b: b[:-1] + b"!", "sha256")])
def test_a_damaged_blob_is_rejected_never_deserialized_and_its_authentic_record_rebuilt(records, tmp_path, signer,
                                                                                        damage, reason):
    blob = publish(records, CONV, signer)
    records.blobs[hashlib.sha256(blob).hexdigest()] = damage(blob)
    pc = client(records, tmp_path, signer)
    assert pc.plan(CONV).source == "rebuild" and pc._backend.deserialized == []
    s = pc.stats()
    assert s.rejects == {reason: 1} and s.hits == {"rebuild": 1} and s.misses == 1 and s.fallbacks["server"] == 1
    folder = tmp_path / "cache" / H200.env_id  # no entry written (a dot file is bookkeeping: a fetch lock)
    assert not folder.exists() or not [p for p in folder.iterdir() if not p.name.startswith(".")]


@pytest.mark.parametrize(("who", "reason"), [("unknown", "unknown_signer"), ("nobody", "unsigned")])
def test_a_plan_not_signed_by_a_trusted_key_is_refused_and_built_locally(records, tmp_path, signer, who, reason):
    publish(records, CONV, new_signer() if who == "unknown" else None)
    pc = client(records, tmp_path, signer)
    assert pc.plan(CONV).source == "heuristic" and pc._backend.deserialized == []
    assert pc.stats().rejects == {reason: 1}


def test_concurrent_callers_of_one_spec_share_one_load(tmp_path, signer):
    backend = RecordingBackend()
    pc = client(None, tmp_path, signer, backend=backend)
    with ThreadPoolExecutor(8) as pool:
        plans = list(pool.map(lambda _: pc.plan(CONV), range(16)))
    assert all(p is plans[0] for p in plans)
    assert len(backend.calls) == 1 and pc.stats().hits == {"heuristic": 1, "memory": 15}


def test_a_loaded_plan_is_served_while_another_thread_builds(tmp_path, signer):
    release = threading.Event()

    class SlowBuilds(RecordingBackend):
        def build_heuristic(self, spec, kernel_cache, *, graph=None):
            if spec.graph_key == SDPA.graph_key:
                assert release.wait(10)
            return super().build_heuristic(spec, kernel_cache, graph=graph)

    pc = client(None, tmp_path, signer, backend=SlowBuilds())
    conv = pc.plan(CONV)
    with ThreadPoolExecutor(1) as pool:
        building = pool.submit(pc.plan, SDPA)
        time.sleep(0.05)
        t0 = time.monotonic()
        assert pc.plan(CONV) is conv
        assert time.monotonic() - t0 < 0.5 and not building.done()
        release.set()
        assert building.result(timeout=10).source == "heuristic"
    assert pc.stats().hits == {"heuristic": 2, "memory": 1}


def test_a_damaged_disk_entry_is_rejected_dropped_and_replaced_from_the_records(records, tmp_path, signer):
    blob = publish(records, CONV, signer)
    with client(records, tmp_path, signer) as first:  # closing finishes the disk cache's background writes
        first.plan(CONV)
    folder = tmp_path / "cache" / H200.env_id
    blob_file = blob_path(folder, hashlib.sha256(blob).hexdigest())
    data = bytearray(blob_file.read_bytes())
    data[3] ^= 0xFF
    blob_file.write_bytes(bytes(data))
    pc = client(records, tmp_path, signer)
    assert pc.plan(CONV).source == "server"
    assert pc.stats().rejects == {"sha256": 1} and pc._backend.deserialized == [blob]
    pc.close()
    assert blob_file.read_bytes() == blob  # rewritten whole
    publish(records, SDPA, signer)  # a record file swapped in from another graph is refused by graph key
    with client(records, tmp_path, signer) as third:
        third.plan(SDPA)
    (folder / f"{CONV.graph_key}.json").write_bytes((folder / f"{SDPA.graph_key}.json").read_bytes())
    offline = client(None, tmp_path, signer)
    assert offline.plan(CONV).source == "heuristic"
    assert offline.stats().rejects == {"graph_key": 1} and offline._backend.deserialized == []


def test_a_disk_blob_of_the_wrong_size_is_refused_before_a_byte_of_it_is_read(tmp_path, signer, monkeypatch):
    """The disk step hashed a blob file whole before its size step: a 1 GiB (sparse) file planted under a plan's
    name took 5.4 s and 1.2 GiB of memory to be refused for its size; a larger one exhausted memory."""
    blob = blob_of(CONV)
    with client(None, tmp_path, signer) as seeding:
        seeding.disk.save(make_record(CONV.graph_key, H200, blob, signer), blob)
    os.truncate(blob_path(tmp_path / "cache" / H200.env_id, hashlib.sha256(blob).hexdigest()), 64 * 2**20)
    pulled: list[int] = []

    def counted(data: Any) -> Any:
        for piece in chunks(data):
            pulled.append(len(piece))
            yield piece

    monkeypatch.setattr("plancache.blobs.folder.chunks", counted)
    pc = client(None, tmp_path, signer, mode="strict")
    assert pc.plan(CONV).source == "rebuild"  # its record is authentic: its (engine_id, knobs) built here
    assert pc.stats().rejects == {"size": 1} and pc._backend.deserialized == [] and pulled == []
    pc.close()
    assert pc.disk.record(CONV.graph_key) is None  # the entry was dropped


def test_prefetch_resolves_everything_in_one_round_trip(records, tmp_path, signer):
    for name in ("conv_bias_relu", "conv_bias_relu_n8", "sdpa_causal"):
        publish(records, SPECS[name], signer)
    specs = list(SPECS.values())
    pc = client(records, tmp_path, signer)
    plans = pc.prefetch(specs + [CONV])
    assert set(plans) == {s.graph_key for s in specs}
    assert Counter(p.source for p in plans.values()) == {"server": 3, "heuristic": 2}
    assert records.calls == {"resolve": 1, "specs": 2}  # and the two missed specs registered
    assert all(pc.plan(s) is plans[s.graph_key] for s in specs)
    assert records.calls == {"resolve": 1, "specs": 2} and pc.stats().hits["memory"] == len(specs)
    pc.close()  # the process exits: its background disk writes are finished
    again = MemoryRecords()  # a second process finds the three tuned plans on disk and asks only for the others
    again.specs.update(records.specs)
    assert Counter(p.source for p in client(again, tmp_path, signer).prefetch(specs).values()) == {
        "disk": 3, "heuristic": 2}
    assert again.calls == {"resolve": 1} and set(again.misses) == {s.graph_key for s in specs} - set(records.records)


def test_strict_and_replay_only_modes_serve_tuned_plans_only(records, tmp_path, signer):
    publish(records, CONV, signer)
    publish(records, SDPA, new_signer())  # unknown signer
    matmul = publish(records, MATMUL, signer)
    records.blobs[hashlib.sha256(matmul).hexdigest()] = b"junk"
    pc = client(records, tmp_path, signer, mode="strict")
    assert pc.plan(CONV).source == "server"
    with pytest.raises(PlanMiss, match=r"sdpa_causal.*strict mode.*server: rejected \(unknown_signer\)"):
        pc.plan(SDPA)
    assert pc.plan(MATMUL).source == "rebuild"  # an authentic tuned record whose blob was damaged
    with pytest.raises(PlanMiss, match="conv_bias_relu_n8"):
        pc.plan(SPECS["conv_bias_relu_n8"])
    assert pc._backend.deserialized == [blob_of(CONV)]
    assert not [c for c in pc._backend.calls if c[0].startswith("heuristic")]
    with pytest.raises(PlanMiss, match=r"2 of 3 graphs .*sdpa_causal.*conv_bias_relu_n16"):
        client(records, tmp_path / "p", signer, mode="strict").prefetch([CONV, SDPA, SPECS["conv_bias_relu_n16"]])
    replay = client(records, tmp_path / "r", signer, mode="replay_only")
    assert replay.plan(CONV).source == "server"
    with pytest.raises(PlanMiss, match="replay_only"):
        replay.plan(MATMUL)
    assert [c[0] for c in replay._backend.calls] == ["deserialize"]


def test_a_verified_blob_that_cudnn_refuses_falls_back_to_the_engine_config(records, tmp_path, signer):
    publish(records, CONV, signer)
    pc = client(records, tmp_path, signer, backend=RecordingBackend(fail=("deserialize",)))
    assert pc.plan(CONV).source == "rebuild" and pc.stats().rejects == {"deserialize": 1}
    both = client(records, tmp_path / "b", signer, backend=RecordingBackend(fail=("deserialize", "engine_config")))
    assert both.plan(CONV).source == "heuristic" and both.stats().fallbacks["rebuild"] == 1


def test_an_older_signed_record_is_refused_once_a_newer_one_was_accepted(records, tmp_path, signer):
    """A replay: a validly signed but older record of a key, served by a hostile source or left in the disk cache,
    is refused (``revision``) once this cache folder accepted a newer one."""
    key, old_blob = CONV.graph_key, b"the plan before the re-tune" * 30
    old = make_record(key, H200, old_blob, signer)
    time.sleep(0.002)  # a revision is the signing time in ms
    publish(records, CONV, signer)
    new = records.records[key]
    assert new.revision > old.revision
    with client(records, tmp_path, signer) as first:
        assert first.plan(CONV).source == "server" and first.disk.revision(key) == new.revision
    folder = tmp_path / "cache" / H200.env_id
    (folder / f"{key}.json").unlink()  # evicted: the next process asks again, and is answered the older record
    hostile = MemoryRecords()
    hostile.publish(old, old_blob)
    replayed = client(hostile, tmp_path, signer)
    assert replayed.plan(CONV).source == "heuristic" and replayed._backend.deserialized == []
    assert replayed.stats().rejects == {"revision": 1}


# ------------------------------------------------------------------ misses


def test_a_first_miss_takes_two_round_trips_and_a_registered_key_s_miss_one(records, tmp_path, signer):
    """Resolve says why each key is missing, so a first miss is the resolve and the spec's registration; the miss
    of a key whose spec the server has is the resolve alone."""
    pc = client(records, tmp_path, signer, mode="strict")
    with pytest.raises(PlanMiss):
        pc.plan(CONV)
    assert round_trips(records) == 2 and records.calls == {"resolve": 1, "specs": 1}
    assert CONV.graph_key in records.specs
    other = client(records, tmp_path / "o", signer, mode="strict")
    with pytest.raises(PlanMiss, match=REGISTERED.message):
        other.plan(CONV)
    assert records.calls == {"resolve": 2, "specs": 1}


def test_a_miss_says_why_in_the_server_s_words(records, tmp_path, signer):
    records.specs[SDPA.graph_key] = SDPA
    records.reasons[SDPA.graph_key] = MissReason(reason="queued", message="queued for tuning (job 3)", job_id=3)
    pc = client(records, tmp_path, signer, mode="strict")
    with pytest.raises(PlanMiss, match=rf"server: no plan: {UNREGISTERED.message}; rebuild"):
        pc.plan(CONV)
    with pytest.raises(PlanMiss, match=r"server: no plan: queued for tuning \(job 3\)"):
        pc.plan(SDPA)
    assert pc.stats().miss_reasons == {"not_registered": 1, "queued": 1}
    assert records.calls == {"resolve": 2, "specs": 1}  # SDPA's spec is there already


def test_a_process_asks_about_a_missed_key_once_a_minute_not_at_every_load(records, tmp_path, signer):
    """A strict process that loads a missed graph on every call (catching ``PlanMiss``; or FE building it again
    through the hook) asked the server at every load and counted a miss each time: one process reached autotune's
    ``MIN_MISSES`` alone and spent its token's miss budget. It asks again once ``MISS_RECHECK_SECONDS`` passed."""
    pc = client(records, tmp_path, signer, mode="strict")
    for _ in range(3):
        with pytest.raises(PlanMiss, match=rf"server: no plan( \d+ s ago)?: {UNREGISTERED.message}"):
            pc.plan(CONV)
    assert records.misses == {CONV.graph_key: 1} and records.calls == {"resolve": 1, "specs": 1}
    assert pc.stats().miss_reasons == {"not_registered": 3}
    publish(records, CONV, signer)  # tuned meanwhile: taken once the process asks again
    a_minute_on(pc)
    assert pc.plan(CONV).source == "server" and records.calls["resolve"] == 2


@pytest.mark.parametrize(("error", "retried"), [
    (ServerUnavailable("429 over budget", throttled=True), True), (ServerUnavailable("503 overloaded"), True),
    (RequestTimeout(), True), (Forbidden("this token may not register specs"), False), (SpecError("refused"), False),
])
def test_a_registration_that_failed_for_now_is_sent_again_at_a_later_miss(records, tmp_path, signer, error, retried):
    """A registration refused by a rate limit (429), an overloaded server (503), or whose body came in too slowly
    (408) is sent again when the key is missed again (at most once a minute: the miss memory); one refused for good
    (the token may not, a spec the server will never take) is not. The miss says why the spec was not registered."""
    pc = client(records, tmp_path, signer, mode="strict")
    records.failures["specs"] = [error]
    for _ in range(2):  # the second load within the minute asks nothing
        with pytest.raises(PlanMiss, match=rf"{UNREGISTERED.message}; its spec was not registered: {error.message}"):
            pc.plan(CONV)
    assert records.calls == {"resolve": 1, "specs": 1} and CONV.graph_key not in records.specs
    a_minute_on(pc)
    with pytest.raises(PlanMiss) as exc:
        pc.plan(CONV)
    assert records.calls == {"resolve": 2, "specs": 2 if retried else 1}
    assert (CONV.graph_key in records.specs) is retried
    assert ("its spec was not registered" not in str(exc.value)) is retried


def test_a_failing_registration_is_sent_at_most_a_few_times(records, tmp_path, signer):
    pc = client(records, tmp_path, signer, mode="strict")
    records.failures["specs"] = [ServerUnavailable("503 overloaded") for _ in range(2 * REGISTER_ATTEMPTS)]
    for _ in range(2 * REGISTER_ATTEMPTS):
        with pytest.raises(PlanMiss):
            pc.plan(CONV)
        a_minute_on(pc)
    assert records.calls["specs"] == REGISTER_ATTEMPTS and CONV.graph_key not in records.specs


def test_a_key_left_out_of_the_answer_is_an_unexplained_miss_and_a_reason_not_asked_for_is_ignored(
        records, tmp_path, signer):
    resolve = records.resolve

    def confused(*args: Any, **kwargs: Any) -> Any:  # a server that lists no miss, and explains another key
        return resolve(*args, **kwargs).model_copy(update={"missing": [], "reasons": {SDPA.graph_key: UNREGISTERED}})

    records.resolve = confused  # type: ignore[method-assign]
    pc = client(records, tmp_path, signer, mode="strict")
    with pytest.raises(PlanMiss, match="server: no plan for this environment"):
        pc.plan(CONV)
    (step,) = [s for s in pc.steps if isinstance(s, ServerStep)]
    assert pc.stats().miss_reasons == {"unexplained": 1} and step.missed.get(SDPA.graph_key) is None
    assert records.calls == {"resolve": 1, "specs": 1}


def test_the_withdrawal_a_miss_s_reason_carries_raises_the_revision_floor(records, tmp_path, signer):
    from plancache.protocol import Withdrawal

    record = make_record(CONV.graph_key, H200, blob_of(CONV), signer)
    withdrawal = signer.sign_withdrawal(Withdrawal(
        graph_key=CONV.graph_key, environment=H200, withdrawn_revision=record.revision,
        blob_sha256=record.blob_sha256, reason="wrong results"))
    records.reasons[CONV.graph_key] = MissReason(reason="withdrawn", message="withdrawn", withdrawal=withdrawal)
    pc = client(records, tmp_path, signer, mode="strict")
    with pytest.raises(PlanMiss, match="server: no plan: withdrawn"):
        pc.plan(CONV)
    assert pc.stats().withdrawals == {"applied": 1} and pc.disk.revision(CONV.graph_key) == withdrawal.revision
    assert records.calls == {"resolve": 1}  # a withdrawn key's spec is known: nothing registered


def test_revalidation_applies_the_withdrawal_a_resolve_answer_gives(records, tmp_path, signer):
    """The reason of a withdrawn key carries the signed withdrawal: the disk entry of the withdrawn plan is
    deleted and its revision refused from then on."""
    from plancache.protocol import Withdrawal

    blob = publish(records, CONV, signer)
    with client(records, tmp_path, signer) as first:
        first.plan(CONV)
    record = records.records.pop(CONV.graph_key)
    withdrawal = signer.sign_withdrawal(Withdrawal(
        graph_key=CONV.graph_key, environment=H200, withdrawn_revision=record.revision,
        blob_sha256=hashlib.sha256(blob).hexdigest(), reason="wrong results"))
    records.reasons[CONV.graph_key] = MissReason(reason="withdrawn", message="withdrawn", withdrawal=withdrawal)
    pc = client(records, tmp_path, signer, mode="strict", revalidate_seconds=0)
    assert pc.plan(CONV).source == "disk"  # served at once; asked about again in the background
    pc.close()
    assert pc.stats().revalidations == {"withdrawn": 1} and pc.disk.record(CONV.graph_key) is None


# ------------------------------------------------------------------ local builds and the ladder's shape


def test_a_shape_family_shares_one_kernel_cache(tmp_path, signer):
    backend = RecordingBackend()
    pc = client(None, tmp_path, signer, backend=backend)
    convs = [pc.plan(SPECS[n]) for n in ("conv_bias_relu_n8", "conv_bias_relu_n16", "conv_bias_relu")]
    sdpa = pc.plan(SDPA)
    caches = [p._built.kernel_cache for p in convs]
    assert caches[0] is caches[1] is caches[2] is not None
    assert sdpa._built.kernel_cache is not None and sdpa._built.kernel_cache is not caches[0]
    assert len(backend.kernel_caches) == 2
    assert len({family_key(SPECS[n]) for n in ("conv_bias_relu_n8", "conv_bias_relu_n16", "conv_bias_relu")}) == 1
    assert family_key(CONV) != family_key(SDPA)
    nchw = CONV.to_json()  # another layout (NCHW instead of NHWC) is another family
    for t in nchw["tensors"]:
        if t["dim"]:
            t["stride"] = contiguous_strides(t["dim"])
    assert family_key(nchw) != family_key(CONV)


def test_a_family_whose_dynamic_build_fails_is_built_statically(tmp_path, signer):
    backend = RecordingBackend(fail=("dynamic",))
    pc = client(None, tmp_path, signer, backend=backend)
    assert pc.plan(SPECS["conv_bias_relu_n8"]).source == "heuristic"
    assert pc.plan(SPECS["conv_bias_relu_n16"]).source == "heuristic"
    assert [c[0] for c in backend.calls] == ["heuristic_dynamic", "heuristic", "heuristic"]


def test_a_failing_local_build_raises(tmp_path, signer):
    pc = client(None, tmp_path, signer, backend=RecordingBackend(fail=("dynamic", "heuristic")))
    with pytest.raises(RuntimeError, match="no engine supports"):
        pc.plan(CONV)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        PlanCache(None, backend=RecordingBackend(), mode="lenient", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="request_deadline"):
        PlanCache(None, backend=RecordingBackend(), request_deadline=0, cache_dir=tmp_path)


class Bundled(Step):
    """A custom step (plans shipped with the application, say): its blobs are verified and loaded like any other."""

    name = "bundle"
    builds = Builds.NOTHING

    def __init__(self, cache: PlanCache, entries: dict[str, tuple[Any, bytes]]) -> None:
        super().__init__(cache)
        self.entries = entries

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        found = {}
        for p in batch:
            if p.key not in self.entries:
                p.note(self.name, "no entry")
            elif (plan := self.admit(p, *self.entries[p.key])) is not None:
                found[p] = plan
        return found


class Guess(Step):
    """A custom step that builds without a tuned record, so only the normal mode keeps it."""

    name = "guess"
    builds = Builds.HEURISTIC

    def resolve(self, batch: list[Pending]) -> dict[Pending, Plan]:
        return {}


def test_a_mode_keeps_the_steps_it_allows(tmp_path):
    config = ClientConfig(server_url="", backend=RecordingBackend(), cache_dir=tmp_path, steps=(*LADDER, Guess))
    assert PlanCache(config).config is config
    ladders = {mode: [s.name for s in PlanCache(config, mode=mode).steps] for mode in MODES}
    assert ladders == {"normal": ["memory", "disk", "index", "server", "rebuild", "heuristic", "guess"],
                       "strict": ["memory", "disk", "index", "server", "rebuild"],
                       "replay_only": ["memory", "disk", "index", "server"]}


def test_a_custom_step_joins_the_ladder(records, tmp_path, signer):
    publish(records, SDPA, signer)
    n8 = SPECS["conv_bias_relu_n8"]
    conv, matmul = blob_of(CONV), blob_of(MATMUL)
    entries = {CONV.graph_key: (make_record(CONV.graph_key, H200, conv, signer), conv),
               MATMUL.graph_key: (make_record(MATMUL.graph_key, H200, matmul, signer), matmul[:-1])}  # truncated
    steps = (*LADDER[:2], partial(Bundled, entries=entries), *LADDER[2:])
    pc = client(records, tmp_path, signer, steps=steps)
    assert [s.name for s in pc.steps] == ["memory", "disk", "bundle", "index", "server", "rebuild", "heuristic"]
    plans = pc.prefetch([CONV, SDPA, MATMUL, n8])
    assert {k: p.source for k, p in plans.items()} == {
        CONV.graph_key: "bundle", SDPA.graph_key: "server", MATMUL.graph_key: "rebuild", n8.graph_key: "heuristic"}
    assert sorted(records.misses) == sorted([MATMUL.graph_key, n8.graph_key]) and records.calls["resolve"] == 1
    assert pc._backend.deserialized == [conv, blob_of(SDPA)]
    s = pc.stats()
    assert s.hits == {"bundle": 1, "server": 1, "rebuild": 1, "heuristic": 1}  # the bundle's authentic record rebuilt
    assert s.rejects == {"size": 1} and s.misses == 2
    assert s.fallbacks == {"disk": 4, "bundle": 3, "server": 2, "rebuild": 1}
    assert pc.plan(CONV) is plans[CONV.graph_key] and pc.stats().hits["memory"] == 1
    replay = client(None, tmp_path / "replay", signer, steps=steps, mode="replay_only")
    assert replay.plan(CONV).source == "bundle"
    with pytest.raises(PlanMiss, match=r"disk: no entry; bundle: rejected \(size\); server: none configured$"):
        replay.plan(MATMUL)


def test_trusted_keys_that_name_no_key_are_refused_not_taken_for_none(tmp_path, signer):
    """Before: a trusted_keys folder holding no ``*.pub`` (an unpopulated secret mount, keys named ``*.pem``) was read
    as "no trusted keys configured", so with insecure_allow_unsigned also set an unsigned plan from the disk cache
    was deserialized. After: a value that names key files or folders but no key is refused, as the CLI refuses it."""
    from plancache.errors import SignatureError
    from plancache.signing import keygen

    folder = tmp_path / "keys"
    folder.mkdir()
    (folder / "fleet.pem").write_text("a key under a name the folder is not read for")
    for keys in (folder, [folder], str(folder), f"{folder},{folder}"):
        with pytest.raises(SignatureError, match="names no public key") as err:
            PlanCache("", trusted_keys=keys, insecure_allow_unsigned=True, cache_dir=tmp_path / "c",
                      backend=RecordingBackend())
        assert err.value.reason == "bad_key" and "trusted_keys" in err.value.message
    # one named folder holding no key next to one that does (a new key's unpopulated mount during a rotation): the
    # empty one is refused, naming it, not dropped (before: the other folder's key alone was trusted, silently)
    keygen(tmp_path / "fleet", "k")
    for keys in (f"{tmp_path / 'fleet'},{folder}", [tmp_path / "fleet", folder], " , "):
        with pytest.raises(SignatureError, match="names no public key") as err:
            PlanCache("", trusted_keys=keys, cache_dir=tmp_path / "c", backend=RecordingBackend())
        assert err.value.reason == "bad_key" and (str(folder) in err.value.message or keys == " , ")
    for keys in (None, "", []):  # none named: no trusted keys, as before
        pc = PlanCache("", trusted_keys=keys, cache_dir=tmp_path / "c", backend=RecordingBackend())
        assert not pc.signatures_checked
        pc.close()


def test_close_reports_the_refused_plans_to_the_records_source(records, tmp_path, signer):
    publish(records, CONV, None)
    pc = client(records, tmp_path, signer)
    assert pc.plan(CONV).source == "heuristic"
    pc.close()
    assert records.rejects == {"unsigned": 1}

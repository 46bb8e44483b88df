"""Blob verification (:mod:`plancache.verify`): each failure has its reason, the steps run in the documented
order, and every place that admits a blob (client, bundle, server publish, worker, spool) goes through it."""

from __future__ import annotations

import base64
import logging
from typing import Any

import pytest

import plancache.bundle
import plancache.client.context
import plancache.store.plans
import plancache.worker.loop
import plancache.worker.spool
import plancache.worker.upload
from plancache import verify
from plancache.bundle import BundlePlan, build_bundle, load_bundle, write_bundle
from plancache.client import PlanCache
from plancache.errors import EnvironmentMismatch, IntegrityError, NotFound, SignatureError, VerificationError
from plancache.signing import TrustedKeys
from plancache.verify import REASONS, verify_blob
from plancache.worker import Spool, SpoolEntry
from plancache.worker.upload import tuned_meta
from tests.client_fakes import RecordingBackend
from tests.factories import CONV_SPEC, H200, OTHER_GPU, make_meta, make_record, new_signer, trusted
from tests.integration.test_client_ladder import blob_path
from tests.worker_fakes import FakeTunedPlan

KEY = "a" * 64
OTHER_KEY = "b" * 64
BLOB = b"\x00serialized-cudnn-plan\xff" * 10
CORRUPT = BLOB[:-1] + bytes([BLOB[-1] ^ 0x40])  # same size, other digest
SPEC = CONV_SPEC
STEPS = ("size", "sha256", "signature", "graph_key", "environment", "revision")
CALLERS = (plancache.client.context, plancache.bundle, plancache.store.plans, plancache.worker.upload,
           plancache.worker.spool)


@pytest.fixture(scope="module")
def signer():
    return new_signer()


def reason(meta, blob=BLOB, *, key=KEY, env=H200, keys=None, min_revision=None) -> str | None:
    try:
        verify_blob(meta, blob, what="plan", graph_key=key, environment=env, trusted=keys, min_revision=min_revision)
    except VerificationError as exc:
        return exc.reason
    return None


def test_a_good_signed_blob_passes(signer):
    assert reason(make_meta(KEY, H200, BLOB, signer), keys=trusted(signer)) is None


def test_without_trusted_keys_the_digest_is_still_checked():
    assert reason(make_meta(KEY, H200, BLOB)) is None
    assert reason(make_meta(KEY, H200, BLOB), keys=TrustedKeys([])) is None
    corrupted = BLOB[:5] + bytes([BLOB[5] ^ 1]) + BLOB[6:]
    assert reason(make_meta(KEY, H200, BLOB), corrupted) == "sha256"


def test_a_required_signature_without_trusted_keys_fails_at_the_signature_step(signer):
    """The client requires signatures: without a key to check one with, even a signed plan is refused."""
    meta = make_meta(KEY, H200, BLOB, signer)
    for keys in (None, TrustedKeys([])):
        with pytest.raises(VerificationError, match="no trusted keys are configured") as err:
            verify_blob(meta, BLOB, what="plan", trusted=keys, require_signature=True)
        assert err.value.reason == "no_trusted_keys" and err.value.reason in REASONS
    with pytest.raises(VerificationError) as err:  # size and sha256 still come first
        verify_blob(meta, BLOB[:-1], what="plan", require_signature=True)
    assert err.value.reason == "size"
    verify_blob(meta, BLOB, what="plan", trusted=trusted(signer), require_signature=True)


@pytest.mark.parametrize("case, expected", [
    ("truncated", "size"),
    ("corrupted_byte", "sha256"),
    ("unsigned", "unsigned"),
    ("unknown_signer", "unknown_signer"),
    ("bad_signature", "bad_signature"),
    ("other_graph", "graph_key"),
    ("other_environment", "environment"),
    ("record_env_id_lies", "environment"),
    ("older_revision", "revision"),
])
def test_each_failure_names_its_reason(signer, case, expected):
    keys = trusted(signer)
    meta, blob, key = make_meta(KEY, H200, BLOB, signer), BLOB, KEY
    if case == "truncated":
        blob = BLOB[:-1]
    elif case == "corrupted_byte":
        blob = CORRUPT
    elif case == "unsigned":
        meta = make_meta(KEY, H200, BLOB)
    elif case == "unknown_signer":
        meta = make_meta(KEY, H200, BLOB, new_signer())
    elif case == "bad_signature":
        sig = bytearray(base64.b64decode(meta.envelope.signatures[0].sig))
        sig[0] ^= 1
        signature = meta.envelope.signatures[0].model_copy(update={"sig": base64.b64encode(bytes(sig)).decode()})
        meta = meta.model_copy(update={"envelope": meta.envelope.model_copy(update={"signatures": [signature]})})
    elif case == "other_graph":
        key = OTHER_KEY
    elif case == "other_environment":
        meta = make_meta(KEY, OTHER_GPU, BLOB, signer)
    elif case == "record_env_id_lies":
        meta = make_record(KEY, H200, BLOB, signer).model_copy(update={"env_id": OTHER_GPU.env_id})
    assert expected in REASONS
    min_revision = meta.revision + 1 if case == "older_revision" else meta.revision
    assert reason(meta, blob, key=key, keys=keys, min_revision=min_revision) == expected


def test_messages_name_the_plan_and_the_mismatch(signer):
    with pytest.raises(VerificationError, match=rf"^entry 3: blob size {len(BLOB) - 1} does not match its "
                                                rf"record's {len(BLOB)} bytes"):
        verify_blob(make_meta(KEY, H200, BLOB), BLOB[:-1], what="entry 3")
    with pytest.raises(SignatureError, match=r"^entry 3 is unsigned") as err:
        verify_blob(make_meta(KEY, H200, BLOB), BLOB, what="entry 3", trusted=trusted(signer))
    assert (err.value.reason, err.value.message) == ("unsigned", "entry 3 is unsigned")  # reason first, like its base
    with pytest.raises(VerificationError, match=f"^entry 3: its record is for graph key {KEY}, expected {OTHER_KEY}"):
        verify_blob(make_meta(KEY, H200, BLOB), BLOB, what="entry 3", graph_key=OTHER_KEY)


def test_a_signature_over_other_fields_does_not_verify(signer):
    """The signature covers the engine config: changing the knobs after signing is caught."""
    meta = make_meta(KEY, H200, BLOB, signer).model_copy(update={"knobs": {"TILE_M": 3}})
    assert reason(meta, keys=trusted(signer)) == "bad_signature"


def test_steps_run_in_order(signer):
    keys = trusted(signer)
    # Everything wrong at once: size is reported first.
    everything = make_meta(OTHER_KEY, OTHER_GPU, BLOB + b"x")
    assert reason(everything, BLOB, keys=keys) == "size"
    # Right size, wrong digest, unsigned, other key and env: sha256 comes before the signature.
    assert reason(make_meta(OTHER_KEY, OTHER_GPU, b"y" * len(BLOB)), keys=keys) == "sha256"
    # Intact blob, unsigned, other graph and env: the signature comes before the graph key.
    assert reason(make_meta(OTHER_KEY, OTHER_GPU, BLOB), keys=keys) == "unsigned"
    # Signed, other graph and env: graph key before environment.
    assert reason(make_meta(OTHER_KEY, OTHER_GPU, BLOB, signer), keys=keys) == "graph_key"
    # Signed, other env, older than one accepted before: environment before revision.
    old = make_meta(KEY, OTHER_GPU, BLOB, signer)
    assert reason(old, keys=keys, min_revision=old.revision + 1) == "environment"


def test_steps_not_asked_for_are_skipped(signer):
    """Unsigned, other graph, other GPU: only what the caller asks for fails."""
    meta = make_meta(OTHER_KEY, OTHER_GPU, BLOB)
    verify_blob(meta, BLOB, what="plan")  # size and sha256 only
    verify_blob(meta, None, what="plan", graph_key=OTHER_KEY, environment=OTHER_GPU)  # the record alone
    with pytest.raises(VerificationError) as err:
        verify_blob(make_meta(KEY, H200, BLOB, signer), None, what="plan", trusted=trusted(signer),
                    graph_key=KEY, environment=OTHER_GPU)
    assert err.value.reason == "environment"


# ------------------------------------------------------------------ every caller goes through verify_blob


def cascade(signer: Any, key: str) -> list[tuple[str | None, Any, bytes]]:
    """``(first failing step, record, blob)``: each case repairs the previous case's first failure only,
    so the record still fails every later step. For graph ``key`` on ``H200`` with ``signer`` trusted."""
    bad = make_record(OTHER_KEY, OTHER_GPU, BLOB)  # unsigned, other graph, other GPU
    return [
        ("size", bad, BLOB[:-1]),
        ("sha256", bad, CORRUPT),
        ("unsigned", bad, BLOB),
        ("graph_key", make_record(OTHER_KEY, OTHER_GPU, BLOB, signer), BLOB),
        ("environment", make_record(key, OTHER_GPU, BLOB, signer), BLOB),
        (None, make_record(key, H200, BLOB, signer), BLOB),
    ]


@pytest.fixture
def calls(monkeypatch) -> list[tuple[tuple[str, ...], str | None]]:
    """Every call of the shared routine by a caller module: ``(steps asked for, reason raised or None)``."""
    seen: list[tuple[tuple[str, ...], str | None]] = []

    def spy(record: Any, blob: bytes | None, **kw: Any) -> None:
        asked = dict(zip(STEPS, (blob is not None, blob is not None, bool(kw.get("trusted")),
                                 kw.get("graph_key") is not None, kw.get("environment") is not None,
                                 kw.get("min_revision") is not None)))
        steps = tuple(s for s in STEPS if asked[s])
        try:
            verify.verify_blob(record, blob, **kw)
        except VerificationError as exc:
            seen.append((steps, exc.reason))
            raise
        seen.append((steps, None))

    for module in CALLERS:
        monkeypatch.setattr(module, "verify_blob", spy)
    return seen


def test_every_caller_binds_the_one_routine():
    assert all(module.verify_blob is verify.verify_blob for module in CALLERS)
    assert plancache.worker.loop.tuned_meta is tuned_meta  # the loop and the upload share the worker's check


def test_client_admits_a_blob_through_every_step_in_order(signer, calls, tmp_path):
    """The client's disk rung: an entry failing several steps is rejected for the first of them. Its blob store
    checks the bytes against their name as it reads them (size, then sha256), the shared routine the rest."""
    folder = tmp_path / "cache" / H200.env_id
    folder.mkdir(parents=True)
    for expected, record, blob in cascade(signer, SPEC.graph_key):
        (folder / f"{SPEC.graph_key}.json").write_text(record.model_dump_json())
        blob_path(folder, record.blob_sha256).write_bytes(blob)
        calls.clear()
        pc = PlanCache("", backend=RecordingBackend(), cache_dir=tmp_path / "cache", trusted_keys=trusted(signer))
        plan = pc.plan(SPEC)
        if expected in ("size", "sha256"):  # refused by the store's read; only the record is checked, to learn it
            assert calls and all("sha256" not in steps for steps, _ in calls)
        else:
            assert calls[0] == (STEPS, expected)
        assert pc.stats().rejects == ({expected: 1} if expected else {})
        assert plan.source == ("disk" if expected is None else "heuristic")  # the record is never authentic
        assert pc._backend.deserialized == ([blob] if expected is None else [])


@pytest.mark.parametrize("with_keys", [True, False])
def test_bundle_entries_go_through_every_step_in_order(signer, calls, tmp_path, with_keys):
    """A bundle entry is checked against its header's environment and the key of its enclosed spec (a bundle
    has no revisions to compare with)."""
    keys = trusted(signer) if with_keys else None
    steps = tuple(s for s in STEPS if s != "revision" and (with_keys or s != "signature"))
    for expected, record, blob in cascade(signer, SPEC.graph_key):
        if not with_keys and expected == "unsigned":
            expected = "graph_key"
        path = tmp_path / "bundle.json"
        write_bundle(build_bundle(H200, [BundlePlan(record, blob, SPEC.to_json())], signer), path)
        calls.clear()
        if expected is None:
            assert [p.blob for p in load_bundle(path, keys)] == [blob]
        else:
            with pytest.raises(VerificationError, match=r"^bundle entry 0 \(graph key") as err:
                load_bundle(path, keys)
            assert err.value.reason == expected
        assert calls == [(steps, expected)]


def test_server_publish_checks_size_then_sha256_only(store, calls, signer):
    """Publishing checks the blob against its record (IntegrityError, 422); signature, key and GPU are not its
    business (the unsigned record of an unknown graph passes verification and stops at the missing spec)."""
    for expected, record, blob in cascade(signer, KEY)[:3]:
        failed = None if expected == "unsigned" else expected
        calls.clear()
        with pytest.raises(NotFound if failed is None else IntegrityError) as err:
            store.publish_plan(make_meta(record.graph_key, record.environment, BLOB), blob)
        assert calls == [(("size", "sha256"), failed)]
        if failed == "size":
            assert err.value.message.startswith(f"plan {OTHER_KEY} on NVIDIA A100")
            assert f"blob size {len(BLOB) - 1}" in err.value.message


def test_worker_checks_a_tuned_blob_size_sha256_then_environment(calls):
    """One helper for the loop and ``plancache tune --server``: digest before environment."""
    bad = FakeTunedPlan(blob=BLOB, sha256="0" * 64, environment=OTHER_GPU)
    with pytest.raises(IntegrityError, match="sha256"):
        tuned_meta(bad, KEY, "w1", H200)
    with pytest.raises(EnvironmentMismatch, match=f"tuned for graph {KEY[:12]}.*expected NVIDIA H200"):
        tuned_meta(FakeTunedPlan(blob=BLOB, sha256=make_meta(KEY, H200, BLOB).blob_sha256, environment=OTHER_GPU),
                   KEY, "w1", H200)
    good = FakeTunedPlan(blob=BLOB, sha256=make_meta(KEY, H200, BLOB).blob_sha256, environment=H200)
    assert tuned_meta(good, KEY, "w1", H200).blob_size == len(BLOB)
    steps = ("size", "sha256", "environment")
    assert calls == [(steps, "sha256"), (steps, "environment"), (steps, None)]


def test_spool_checks_size_then_sha256(calls, tmp_path, caplog):
    """The spool's blob store refuses bytes that do not hash to the record's sha256 when they are saved (and when
    read back: tests/unit/test_worker_units.py); what it reads is checked against the record's size and sha256 by
    the shared routine. The record's signature, graph and GPU are not the spool's business."""
    spool = Spool(tmp_path / "spool")
    meta = make_meta(OTHER_KEY, OTHER_GPU, BLOB)
    for _, _, blob in cascade(None, KEY)[:2]:  # truncated, corrupted
        with pytest.raises(IntegrityError):
            spool.save(SpoolEntry(9, "lease-token", "w1", meta, {}, blob))
    other = b"other plan bytes" * 10
    wrong_size = make_meta(OTHER_KEY, OTHER_GPU, other).model_copy(update={"blob_size": len(other) + 1})
    entries = [SpoolEntry(1, "lease-token", "w1", meta, {}, BLOB), SpoolEntry(2, "lease-token", "w1", wrong_size, {},
                                                                               other)]
    for entry in entries:
        spool.save(entry)
    calls.clear()
    with caplog.at_level(logging.ERROR, logger="plancache.worker"):
        assert [e.job_id for e in spool.pending()] == [1]
    assert sorted(calls, key=str) == sorted([(("size", "sha256"), None), (("size", "sha256"), "size")], key=str)
    assert f"{entries[1].name}.json: blob size {len(other)}" in caplog.text

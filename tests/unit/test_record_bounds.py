"""Bounded records (issue 23 item 3): every field of a plan record has a bound, so that the largest record there can
be is small; the candidates table of a tuning run is capped (:class:`CandidateTable`) and travels beside the record.
Before: a record held up to 10,000 candidates, and a valid 6,000-candidate record was 52 MiB."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from plancache.environment import Environment
from plancache.protocol import (
    MAX_CANDIDATES,
    MAX_CANDIDATES_BYTES,
    MAX_ENVELOPE_PAYLOAD,
    MAX_JOB_ID,
    MAX_KNOBS,
    MAX_RECORD_BYTES,
    MAX_WITHDRAWAL_REASON,
    NATIVE_KERNELS,
    Candidate,
    CandidateTable,
    DsseSignature,
    Envelope,
    PlanMeta,
    PlanRecord,
    ResolvedPlan,
    Withdrawal,
)
from plancache.validation import INT64_MAX, MAX_MS, MAX_SECONDS
from tests.factories import H200, make_meta, make_record, new_signer

#: A character JSON writes as 6 bytes (``\u0001``): strings made of it are the longest their bounds allow.
WIDE = "\x01"
INT_MIN = -INT64_MAX - 1


def _knobs(i: int = 0) -> dict[str, int]:
    return {f"K{i}_{j:02d}".ljust(64, "X"): INT_MIN for j in range(MAX_KNOBS)}


def _widest_env() -> Environment:
    return Environment(sm=1000, sm_count=100_000, cudnn_version=2**31 - 1, driver_version=2**31 - 1,
                       frontend_version="9" * 64,  # a version's characters are all narrow
                       device_name=WIDE * 256, cuda_runtime=WIDE * 64,
                       torch_version=WIDE * 64)


def _widest_meta() -> PlanMeta:
    return PlanMeta(graph_key="f" * 64, environment=_widest_env(), blob_sha256="f" * 64, blob_size=INT64_MAX,
                    revision=INT64_MAX, engine_id=-INT64_MAX, knobs=_knobs(), plan_name=WIDE * 512,
                    workspace_bytes=INT64_MAX, winner_median_ms=MAX_MS - 1e-9, heuristic_median_ms=MAX_MS - 1e-9,
                    worst_median_ms=MAX_MS - 1e-9, native_median_ms=dict.fromkeys(NATIVE_KERNELS, MAX_MS - 1e-9),
                    tuning_seconds=MAX_SECONDS - 1e-9, worker_id=WIDE * 256,
                    numerics_check="cross-check:heuristic")


def _widest_envelope() -> Envelope:
    return Envelope(payloadType=WIDE * 128, payload="A" * MAX_ENVELOPE_PAYLOAD,
                    signatures=[DsseSignature(keyid="k" * 128, sig="A" * 512)] * 8)


def test_the_largest_record_there_can_be_is_at_most_64_kib():
    """Every string at its longest (each character escaped to 6 bytes where the field allows any), every number at
    its widest, 64 knobs, the largest envelope: a resolve answer for N keys, records only, is at most N x this."""
    widest = PlanRecord(**_widest_meta().model_dump(exclude={"envelope"}), envelope=_widest_envelope(), env_id="f" * 32,
                        job_id=MAX_JOB_ID, created_at=datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC))
    size = len(widest.model_dump_json())
    assert 30_000 < size <= MAX_RECORD_BYTES, size  # 35.1 KiB at the bounds
    entry = ResolvedPlan(record=widest, blob_url="https://" + "u" * 8184)
    assert len(entry.model_dump_json()) <= MAX_RECORD_BYTES + 8400


def test_a_signed_statement_at_every_bound_fits_the_envelope():
    """The envelope's payload bound (16 KiB) holds the largest plan statement and withdrawal a signer makes."""
    signer = new_signer()
    signed = signer.sign(_widest_meta().model_copy(update={"revision": 0}))  # the signer's clock sets it
    assert signed.envelope is not None and len(signed.envelope.payload) < MAX_ENVELOPE_PAYLOAD
    withdrawal = Withdrawal(graph_key="f" * 64, environment=_widest_env(), blob_sha256="f" * 64,
                            withdrawn_revision=0, reason=WIDE * MAX_WITHDRAWAL_REASON)
    signed_w = signer.sign_withdrawal(withdrawal)
    assert signed_w.envelope is not None and len(signed_w.envelope.payload) < MAX_ENVELOPE_PAYLOAD


@pytest.mark.parametrize("field, value", [
    ("knobs", {"SPLIT K": 1}),  # a knob name is an identifier
    ("knobs", {"X" * 65: 1}),
    ("knobs", {f"K{i}": 1 for i in range(MAX_KNOBS + 1)}),
    ("plan_name", "n" * 513),
    ("worker_id", "w" * 257),
    ("envelope", {"payloadType": "t", "payload": "not base64!", "signatures": [{"keyid": "k", "sig": "AA=="}]}),
    ("envelope", {"payloadType": "t", "payload": "A" * (MAX_ENVELOPE_PAYLOAD + 4),
                  "signatures": [{"keyid": "k", "sig": "AA=="}]}),
    ("envelope", {"payloadType": "t", "payload": "AA==", "signatures": [{"keyid": "k\n", "sig": "AA=="}]}),
    ("env_id", "x" * 10_000),
    ("native_median_ms", {"Flash attention!": 1.0}),  # not a kernel's name
    ("native_median_ms", {f"k{i}": 1.0 for i in range(9)}),
    ("native_median_ms", {"flash": -1.0}),
    ("native_median_ms", {"cudnn_aten": MAX_MS * 2}),
])
def test_a_field_past_its_bound_is_refused(field, value):
    doc = make_record("0" * 64, H200).model_dump(mode="json")
    with pytest.raises(ValidationError, match=field):
        PlanRecord.model_validate({**doc, field: value})


def test_a_record_states_the_native_kernels_plancache_names():
    """The kernels a worker times beside an attention plan, keyed as the GPU side and clients key them; a record
    states none by default, and one naming a kernel a later release times is read (this release never runs it)."""
    assert NATIVE_KERNELS == ("flash", "cudnn_aten")
    assert make_record("0" * 64, H200).native_median_ms == {}
    doc = make_record("0" * 64, H200).model_dump(mode="json")
    assert PlanRecord.model_validate({**doc, "native_median_ms": {"mem_efficient": 0.5, "flash": 1.0}}) \
        .native_median_ms == {"mem_efficient": 0.5, "flash": 1.0}


def test_a_record_with_candidates_inside_reads_without_them():
    """Records an older server answered, or a client cache or bundle wrote, held the candidates: they still read."""
    record = make_record("0" * 64, H200)
    legacy = {**record.model_dump(mode="json"), "candidates": [{"index": 0, "status": "ok"}] * 6000}
    assert PlanRecord.model_validate(legacy) == record
    assert "candidates" not in PlanMeta.model_fields and "candidates" not in record.model_dump()
    with pytest.raises(ValidationError, match="candidates"):  # a record sent to be stored is strict
        PlanMeta.model_validate({**PlanMeta(**record.model_dump(include=set(PlanMeta.model_fields))).model_dump(),
                                 "candidates": []})


def _row(i: int, status: str = "ok", *, wide: bool = False) -> Candidate:
    extra = {"knobs": _knobs(i), "name": "n" * 512, "error": "e" * 4000} if wide else {}
    return Candidate(index=i, engine_id=i, median_ms=(1.0 + i) if status == "ok" else None, status=status, **extra)


def test_best_of_keeps_the_fastest_within_both_bounds_and_counts_the_rest():
    rows = [_row(i, "build_failed" if i % 3 else "ok") for i in range(6000)]
    table = CandidateTable.best_of(rows)
    assert len(table.candidates) == MAX_CANDIDATES
    assert [c.index for c in table.candidates] == [i for i in range(6000) if i % 3 == 0][:MAX_CANDIDATES]
    assert table.candidates_omitted == {"ok": 2000 - MAX_CANDIDATES, "build_failed": 4000}
    wide = CandidateTable.best_of([_row(i, wide=True) for i in range(600)])  # ~10 KiB a row: the byte cap binds
    assert 100 < len(wide.candidates) < MAX_CANDIDATES and sum(wide.candidates_omitted.values()) == 600 - len(wide.candidates)
    assert len(wide.model_dump_json(include={"candidates"})) <= MAX_CANDIDATES_BYTES + 20
    assert CandidateTable.best_of([]) == CandidateTable()


def test_a_table_over_either_bound_is_refused_naming_the_cap():
    with pytest.raises(ValidationError, match="6000 candidates; a plan carries at most 512"):
        CandidateTable(candidates=[_row(i) for i in range(6000)])
    with pytest.raises(ValidationError, match=f"bytes of JSON; at most {MAX_CANDIDATES_BYTES}"):
        CandidateTable(candidates=[_row(i, wide=True) for i in range(200)])


def test_tune_out_keeps_every_candidate_in_its_local_file(tmp_path):
    """``plancache tune --out`` writes a local file, not a record a server stores: every candidate tried is in it."""
    import hashlib
    import json

    from plancache.cli.tune_cmds import write_result
    from tests.factories import CONV_SPEC
    from tests.worker_fakes import FakeTunedPlan

    blob = b"plan"
    tuned = FakeTunedPlan(blob, hashlib.sha256(blob).hexdigest(), H200, candidates=[_row(i) for i in range(600)])
    tuned.build_seconds, tuned.timing_seconds = 1.0, 2.0  # type: ignore[attr-defined]
    doc = json.loads(write_result(tmp_path, "conv", CONV_SPEC, tuned).read_text())
    assert len(doc["candidates"]) == 600 and doc["graph_key"] == CONV_SPEC.graph_key


def test_a_spooled_result_keeps_its_bounded_table_and_an_older_entry_is_cut(tmp_path):
    """The worker spools ``best_of`` its run beside the signed record, and sends it with the record; an entry spooled
    when the record held the whole list (here 6,000 candidates) is read with that list cut the same way."""
    import hashlib
    import json

    from plancache.worker.spool import Spool, SpoolEntry
    from tests.factories import CONV_SPEC

    blob = b"plan"
    meta = make_meta(CONV_SPEC.graph_key, H200, blob, new_signer())
    rows = [_row(i, "ok" if i % 2 else "build_failed") for i in range(6000)]
    spool = Spool(tmp_path / "spool")
    entry = SpoolEntry(3, "lease", "w1", meta, CONV_SPEC.to_json(), blob, CandidateTable.best_of(rows))
    path = spool.save(entry)
    (loaded,) = spool.pending()
    assert loaded == entry and len(loaded.candidates.candidates) == MAX_CANDIDATES
    upload = loaded.upload()
    assert upload.candidates == entry.candidates.candidates and "candidates" not in upload.model_dump(
        include=set(PlanMeta.model_fields))
    doc = json.loads(path.read_text())
    doc["meta"]["candidates"] = [c.model_dump(mode="json") for c in rows]
    del doc["candidates"]
    path.write_text(json.dumps(doc))
    (older,) = spool.pending()
    assert older.meta == meta and older.candidates == CandidateTable.best_of(rows)
    assert older.candidates.candidates_omitted == {"ok": 3000 - MAX_CANDIDATES, "build_failed": 3000}
    assert hashlib.sha256(older.blob).hexdigest() == meta.blob_sha256

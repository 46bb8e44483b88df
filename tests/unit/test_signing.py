"""Signed records and bundles are plain DSSE envelopes carrying in-toto statements: checked here with an
independent DSSE implementation (PAE written from the specification, ed25519 from ``cryptography``), then every
way an envelope can lie is refused with its reason, and revisions only grow."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from plancache import signing
from plancache.bundle import ENTRIES_SUBJECT, BundlePlan, build_bundle
from plancache.errors import SignatureError
from plancache.protocol import DsseSignature, Envelope, PlanRecord
from plancache.signing import BUNDLE_PREDICATE, PAYLOAD_TYPE, TrustedKeys, next_revision, statement
from tests.factories import CONV_SPEC as SPEC
from tests.factories import H200, OTHER_GPU, make_meta, make_record, new_signer, trusted

KEY = "c" * 64
BLOB = b"\x01serialized plan\xfe" * 16
NATIVE = {"flash": 0.354, "cudnn_aten": 0.261}
DATA = Path(__file__).resolve().parents[1] / "data"


def dsse_pae(payload_type: str, body: bytes) -> bytes:
    """PAE as https://github.com/secure-systems-lab/dsse/blob/master/protocol.md defines it, written apart from
    :func:`plancache.signing.pae`."""
    kind = payload_type.encode("utf-8")
    return b" ".join([b"DSSEv1", str(len(kind)).encode(), kind, str(len(body)).encode(), body])


def dsse_verify(envelope: dict[str, Any], public_key: Ed25519PublicKey) -> dict[str, Any]:
    """A standalone DSSE verifier: the statement, if one of the envelope's signatures verifies with ``public_key``."""
    assert set(envelope) == {"payloadType", "payload", "signatures"}
    body = base64.b64decode(envelope["payload"])
    for signature in envelope["signatures"]:
        assert set(signature) == {"keyid", "sig"}
        try:
            public_key.verify(base64.b64decode(signature["sig"]), dsse_pae(envelope["payloadType"], body))
        except InvalidSignature:
            continue
        return json.loads(body)
    raise AssertionError("no signature verifies")


@pytest.fixture(scope="module")
def signer() -> Any:
    return new_signer()


def reason_of(meta: Any, keys: Any) -> str:
    with pytest.raises(SignatureError) as err:
        keys.verify(meta, what="plan")
    return err.value.reason


def with_envelope(meta: Any, **changes: Any) -> Any:
    return meta.model_copy(update={"envelope": meta.envelope.model_copy(update=changes)})


def repacked(meta: Any, edit: Any) -> Any:
    """``meta`` whose envelope payload (the statement) was edited by ``edit``, its signature left as it was."""
    signed = json.loads(base64.b64decode(meta.envelope.payload))
    edit(signed)
    return with_envelope(meta, payload=base64.b64encode(json.dumps(signed).encode()).decode())


def test_a_signed_record_is_a_standard_dsse_envelope_of_an_in_toto_statement(signer):
    meta = make_record(KEY, H200, BLOB, signer, heuristic_median_ms=0.08, numerics_check="cross-check:fallback")
    wire = json.loads(meta.model_dump_json())["envelope"]  # what the server stores and serves
    assert wire["payloadType"] == "application/vnd.in-toto+json"
    assert [s["keyid"] for s in wire["signatures"]] == [signer.key_id]
    signed = dsse_verify(wire, signer.private_key.public_key())
    assert signed["_type"] == "https://in-toto.io/Statement/v1"
    assert signed["subject"] == [{"name": KEY, "digest": {"sha256": hashlib.sha256(BLOB).hexdigest()}}]
    assert signed["predicateType"] == "https://plancache.dev/plan/v1"
    predicate = signed["predicate"]
    assert predicate == {
        "graph_key": KEY, "environment": H200.validity(), "blob_size": len(BLOB), "engine_id": 7,
        "knobs": {"TILE_M": 2}, "winner_median_ms": 0.05, "heuristic_median_ms": 0.08,
        "numerics_check": "cross-check:fallback", "worker_id": "w-test", "revision": meta.revision,
        "signed_at": predicate["signed_at"],
    }
    signed_at = datetime.fromisoformat(predicate["signed_at"].replace("Z", "+00:00"))
    assert abs(signed_at.timestamp() * 1000 - meta.revision) < 60_000  # the revision is the signing time in ms
    trusted(signer).verify(meta)


def test_standard_tools_verify_a_record(signer):
    """securesystemslib's DSSE verifier accepts the envelope with the signer's public key, and in-toto's own
    Statement v1 parser accepts its payload, subject named by the graph key."""
    dsse = pytest.importorskip("securesystemslib.dsse", reason="securesystemslib is not installed (the dev extra)")
    sslib_signer = pytest.importorskip("securesystemslib.signer")
    statement_mod = pytest.importorskip("in_toto_attestation.v1.statement",
                                        reason="in-toto-attestation is not installed (the dev extra)")
    from google.protobuf import json_format
    from in_toto_attestation.v1 import statement_pb2

    meta = make_record(KEY, H200, BLOB, signer)
    envelope = dsse.Envelope.from_dict(json.loads(meta.model_dump_json())["envelope"])
    key = sslib_signer.SSlibKey.from_crypto(signer.private_key.public_key(), keyid=signer.key_id)
    assert set(envelope.verify([key], threshold=1)) == {signer.key_id}
    proto = json_format.Parse(envelope.pae().split(b" ", 4)[4], statement_pb2.Statement())  # the signed payload
    parsed = statement_mod.Statement.copy_from_pb(proto)
    parsed.validate()
    assert [(s.name, dict(s.digest)) for s in parsed.pb.subject] == [(KEY, {"sha256": hashlib.sha256(BLOB).hexdigest()})]
    other = sslib_signer.SSlibKey.from_crypto(new_signer().private_key.public_key(), keyid=signer.key_id)
    with pytest.raises(Exception, match="(?i)verif|threshold"):
        envelope.verify([other], threshold=1)  # the same key id with another key: refused


def test_records_signed_with_the_earlier_subject_name_still_verify(signer):
    def legacy(statement):
        statement["subject"][0]["name"] = "plan blob"

    meta = make_record(KEY, H200, BLOB, signer)
    signed = json.loads(base64.b64decode(meta.envelope.payload))
    legacy(signed)
    resigned = meta.model_copy(update={"envelope": signer.envelope(signed)})
    trusted(signer).verify(resigned)
    wrong = json.loads(base64.b64decode(meta.envelope.payload))
    wrong["subject"][0]["name"] = "f" * 64  # another graph's name: refused
    with pytest.raises(SignatureError, match=r"signed statement \(graph_key\)"):
        trusted(signer).verify(meta.model_copy(update={"envelope": signer.envelope(wrong)}))


def test_a_signed_bundle_is_a_standard_dsse_envelope_naming_its_entries_digest(signer):
    plans = [BundlePlan(make_record(SPEC.graph_key, H200, BLOB, signer), BLOB, SPEC.to_json())]
    doc = json.loads(json.dumps(build_bundle(H200, plans, signer)))
    signed = dsse_verify(doc["envelope"], signer.private_key.public_key())
    assert signed["predicateType"] == BUNDLE_PREDICATE
    entries = json.dumps(doc["entries"], sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    digest = hashlib.sha256(entries).hexdigest()
    assert signed["subject"] == [{"name": ENTRIES_SUBJECT, "digest": {"sha256": digest}}]
    assert signed["predicate"] == {"header": doc["header"], "entries_sha256": digest}


def test_a_tampered_payload_is_refused(signer):
    keys, meta = trusted(signer), make_meta(KEY, H200, BLOB, signer)
    # The statement rewritten to match a rewritten record: the signature no longer covers it.
    forged = repacked(meta, lambda s: s["predicate"].update(engine_id=666)).model_copy(update={"engine_id": 666})
    assert reason_of(forged, keys) == "bad_signature"
    # The payload type is signed too.
    assert reason_of(with_envelope(meta, payloadType="application/json"), keys) == "bad_signature"
    assert reason_of(with_envelope(meta, payload="not base64!"), keys) == "malformed"


@pytest.mark.parametrize("field, value", [
    ("graph_key", "d" * 64), ("environment", OTHER_GPU), ("blob_sha256", "0" * 64), ("blob_size", 1),
    ("engine_id", 8), ("knobs", {"TILE_M": 4}), ("winner_median_ms", 0.01), ("heuristic_median_ms", 1.0),
    ("numerics_check", "cross-check:heuristic"), ("worker_id", "mallory"), ("revision", 2**40),
    ("native_median_ms", {"flash": 0.3}),
])
def test_a_record_is_authentic_only_if_its_fields_equal_the_signed_predicate(signer, field, value):
    """The envelope verifies, but the record around it says something else: refused, naming the field."""
    meta = make_meta(KEY, H200, BLOB, signer).model_copy(update={field: value})
    with pytest.raises(SignatureError, match=rf"does not match its signed statement \({field}\)") as err:
        trusted(signer).verify(meta, what="plan")
    assert err.value.reason == "bad_signature"


def test_native_timings_are_signed_when_a_record_states_them(signer):
    """A record's native kernel timings are in its predicate when it states any; changing, dropping or clearing
    them after signing is refused, naming ``native_median_ms``."""
    meta = make_meta(KEY, H200, BLOB, signer, native_median_ms=NATIVE)
    assert json.loads(base64.b64decode(meta.envelope.payload))["predicate"]["native_median_ms"] == NATIVE
    trusted(signer).verify(meta)
    for changed in ({**NATIVE, "cudnn_aten": 0.262}, {"flash": NATIVE["flash"]}, {}):
        with pytest.raises(SignatureError, match=r"does not match its signed statement \(native_median_ms\)"):
            trusted(signer).verify(meta.model_copy(update={"native_median_ms": changed}), what="plan")


def test_a_record_signed_without_the_native_timings_field_verifies_unchanged():
    """tests/data/record_without_native_timings.json was signed (key: the ed25519 seed of bytes 0 to 31) by a
    release whose records had no ``native_median_ms``: it reads with none, and its signature still verifies."""
    doc = json.loads((DATA / "record_without_native_timings.json").read_text())
    record = PlanRecord.model_validate(doc)
    assert "native_median_ms" not in doc and record.native_median_ms == {}
    assert "native_median_ms" not in json.loads(base64.b64decode(record.envelope.payload))["predicate"]
    TrustedKeys([Ed25519PrivateKey.from_private_bytes(bytes(range(32))).public_key()]).verify(record)


def test_a_wrong_or_unknown_keyid_is_refused(signer):
    other = new_signer()
    meta = make_meta(KEY, H200, BLOB, signer)
    relabelled = meta.envelope.signatures[0].model_copy(update={"keyid": other.key_id})
    # Signed by one key, labelled as another trusted key: that key's check fails.
    assert reason_of(with_envelope(meta, signatures=[relabelled]), trusted(signer, other)) == "bad_signature"
    # Labelled with a key id no trusted key has.
    assert reason_of(meta, trusted(other)) == "unknown_signer"
    unknown = meta.envelope.signatures[0].model_copy(update={"keyid": "0" * 16})
    with pytest.raises(SignatureError, match="unknown key 0000000000000000"):
        trusted(signer).verify(with_envelope(meta, signatures=[unknown]), what="plan")
    # One good signature among others suffices (DSSE allows several signers).
    extra = DsseSignature(keyid=other.key_id, sig=base64.b64encode(b"\0" * 64).decode())
    trusted(signer, other).verify(with_envelope(meta, signatures=[extra, *meta.envelope.signatures]))


def test_a_verified_payload_that_is_not_a_plan_statement_is_malformed(signer):
    meta = make_meta(KEY, H200, BLOB, signer)
    bundle_statement = signer.envelope(statement([("x", "0" * 64)], BUNDLE_PREDICATE, {}))
    assert reason_of(meta.model_copy(update={"envelope": bundle_statement}), trusted(signer)) == "malformed"
    sig = base64.b64encode(signer.private_key.sign(dsse_pae(PAYLOAD_TYPE, b"{oops"))).decode()
    not_json = Envelope(payloadType=PAYLOAD_TYPE, payload=base64.b64encode(b"{oops").decode(),
                        signatures=[DsseSignature(keyid=signer.key_id, sig=sig)])
    assert reason_of(meta.model_copy(update={"envelope": not_json}), trusted(signer)) == "malformed"
    assert reason_of(meta.model_copy(update={"envelope": None}), trusted(signer)) == "unsigned"


def test_revisions_only_grow(signer, monkeypatch):
    monkeypatch.setattr(signing, "_REVISIONS", signing._Revisions())  # the far-ahead revision below stays here
    first = make_meta(KEY, H200, BLOB, signer)
    again = signer.sign(first)
    assert again.revision > first.revision and again.envelope != first.envelope
    trusted(signer).verify(again)
    ahead = make_meta(KEY, H200, BLOB, revision=2**50)  # a record from a signer whose clock runs far ahead
    assert signer.sign(ahead).revision == 2**50 + 1
    made = [next_revision() for _ in range(1000)]
    assert made == sorted(set(made)) and made[0] > 2**50 + 1  # strictly increasing within the process
    now_ms = datetime.now(UTC).timestamp() * 1000
    assert first.revision <= now_ms + 1000


def test_a_signed_payload_with_a_repeated_key_is_refused(signer):
    """Before: a validly signed statement with "graph_key" twice in its predicate verified (Python keeps the last
    value; a first-key-wins DSSE consumer reads the other). After: refused as malformed."""
    meta = make_record(KEY, H200, BLOB, signer)
    text = base64.b64decode(meta.envelope.payload).decode()
    twice = text.replace('"graph_key":', f'"graph_key":"{"0" * 64}","graph_key":', 1)
    assert twice != text
    forged = meta.model_copy(update={"envelope": signer.envelope(json.loads(text))})
    payload = base64.b64encode(twice.encode()).decode()
    sig = base64.b64encode(signer.private_key.sign(signing.pae(PAYLOAD_TYPE, twice.encode()))).decode()
    forged = forged.model_copy(update={"envelope": Envelope(payloadType=PAYLOAD_TYPE, payload=payload,
                                                            signatures=[DsseSignature(keyid=signer.key_id, sig=sig)])})
    with pytest.raises(SignatureError, match="'graph_key' appears twice") as err:
        trusted(signer).verify(forged)
    assert err.value.reason == "malformed"


def _withdrawal(signer: Any, **fields: Any) -> Any:
    from plancache.protocol import Withdrawal

    record = make_record(KEY, H200, BLOB, signer)
    return signer.sign_withdrawal(Withdrawal(graph_key=KEY, environment=H200, blob_sha256=record.blob_sha256,
                                             withdrawn_revision=record.revision, reason="wrong results", **fields))


def test_a_withdrawal_is_a_standard_dsse_envelope_of_an_in_toto_statement(signer):
    w = _withdrawal(signer)
    assert w.revision > w.withdrawn_revision
    signed = dsse_verify(json.loads(w.model_dump_json())["envelope"], signer.private_key.public_key())
    assert signed["_type"] == "https://in-toto.io/Statement/v1"
    assert signed["subject"] == [{"name": KEY, "digest": {"sha256": hashlib.sha256(BLOB).hexdigest()}}]
    assert signed["predicateType"] == "https://plancache.dev/withdrawal/v1"
    assert signed["predicate"] == {"graph_key": KEY, "environment": H200.validity(), "reason": "wrong results",
                                   "withdrawn_revision": w.withdrawn_revision, "revision": w.revision,
                                   "signed_at": signed["predicate"]["signed_at"]}
    trusted(signer).verify_withdrawal(w, what="withdrawal")


@pytest.mark.parametrize("field, value", [
    ("graph_key", "d" * 64), ("environment", OTHER_GPU), ("blob_sha256", "0" * 64), ("withdrawn_revision", 1),
    ("reason", "another reason"), ("revision", 2**40),
])
def test_a_withdrawal_is_authentic_only_if_its_fields_equal_the_signed_predicate(signer, field, value):
    w = _withdrawal(signer).model_copy(update={field: value})
    with pytest.raises(SignatureError, match=rf"does not match its signed statement \({field}\)") as err:
        trusted(signer).verify_withdrawal(w, what="withdrawal")
    assert err.value.reason == "bad_signature"


def test_a_plan_statement_is_no_withdrawal_and_a_withdrawal_no_plan(signer):
    """The predicate type keeps the two apart: a signed plan record's envelope cannot withdraw it, and a
    withdrawal's envelope cannot pass for a plan."""
    w, meta = _withdrawal(signer), make_meta(KEY, H200, BLOB, signer)
    with pytest.raises(SignatureError) as err:
        trusted(signer).verify_withdrawal(w.model_copy(update={"envelope": meta.envelope}), what="withdrawal")
    assert err.value.reason == "malformed"
    assert reason_of(meta.model_copy(update={"envelope": w.envelope}), trusted(signer)) == "malformed"
    with pytest.raises(SignatureError) as err:
        trusted(new_signer()).verify_withdrawal(w, what="withdrawal")
    assert err.value.reason == "unknown_signer"


def test_verification_reasons_are_one_enum():
    """Every refusal names a :class:`~plancache.errors.Reason`; a reason outside it is a programming error caught at
    once, and a reason still reads (and counts, and serializes) as its plain string."""
    import json

    from plancache.errors import Reason, SignatureError, VerificationError
    from plancache.verify import REASONS

    assert set(REASONS) == set(Reason) - {Reason.BAD_KEY}
    err = SignatureError(Reason.UNKNOWN_SIGNER, "signed by someone else")
    assert err.reason is Reason.UNKNOWN_SIGNER and err.reason == "unknown_signer"
    assert json.dumps({err.reason: 1}) == '{"unknown_signer": 1}'
    assert VerificationError("sha256", "m").reason is Reason.SHA256  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not_a_reason"):
        VerificationError("not_a_reason", "m")  # type: ignore[arg-type]


def test_a_key_file_over_its_limit_or_endless_is_refused_without_reading_it_all(tmp_path):
    """Before: a signing or trusted key file was read whole (/dev/zero: until memory ran out). Now past
    MAX_KEY_FILE_BYTES it is an OSError (EFBIG) naming the file, as an unreadable one is."""
    import errno

    big = tmp_path / "big.pub"
    with big.open("wb") as fh:
        fh.truncate(signing.MAX_KEY_FILE_BYTES + 1)
    for path in (big, "/dev/zero"):
        for load in (signing.Signer.from_file, lambda p: signing.TrustedKeys.from_files([p])):
            with pytest.raises(OSError) as err:
                load(path)
            assert err.value.errno == errno.EFBIG and err.value.filename == str(path)
            assert f"over the limit of {signing.MAX_KEY_FILE_BYTES} bytes" in str(err.value)

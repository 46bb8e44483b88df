"""Signed bundles of any size (issue 37, finding 4): the signed statement does not grow with the bundle, and export
streams one plan at a time.

Figure (this test's 1,000 signed plans, on main 4d1a308): export failed past 72 plans (``Envelope payload String
should have at most 16384 characters``, the statement named every blob); with the fix the 1,000 export, verify and
import, and the envelope's payload is the same size at 1 plan and at 1,000.
"""

from __future__ import annotations

import base64
import json

import pytest

from plancache.bundle import (
    build_bundle,
    export_bundle,
    import_bundle,
    legacy_bundle_statement,
    load_bundle,
    read_bundle,
    write_bundle,
)
from plancache.errors import SignatureError
from plancache.protocol import PlanRecord
from plancache.signing import Signer, TrustedKeys, keygen
from plancache.spec import graph_key
from plancache.store import open_store
from tests.conftest import _spec
from tests.factories import H200, make_meta

PLANS = 1000


class PlansOnly:
    """What an export reads of a store (its keys, records, blobs and specs), in memory: seeding 1,000 plans into
    SQLite takes 7 s of this test's budget, and the store's reads are tested elsewhere."""

    def __init__(self, signer: Signer, n: int) -> None:
        self.specs, self.records, self.blobs = {}, {}, {}
        for i in range(n):
            spec = _spec(i)
            key = graph_key(spec)
            blob = f"plan-{i}".encode() * 8
            meta = signer.sign(make_meta(key, H200, blob, revision=i + 1))
            self.specs[key] = spec
            self.records[key] = PlanRecord.model_validate({**meta.model_dump(), "env_id": H200.env_id,
                                                         "created_at": "2026-01-01T00:00:00Z"})
            self.blobs[meta.blob_sha256] = blob

    def plan_graph_keys(self, env_id: str) -> list[str]:
        return sorted(self.records) if env_id == H200.env_id else []

    def get_plan(self, key: str, environment) -> PlanRecord | None:
        return self.records.get(key)

    def get_blob(self, sha256: str) -> bytes | None:
        return self.blobs.get(sha256)

    def get_spec(self, key: str):
        return self.specs.get(key)


def test_a_signed_bundle_of_1000_plans_exports_and_verifies_and_a_small_one_imports(tmp_path):
    private, public, _ = keygen(tmp_path / "keys", "ops")
    signer, trusted = Signer.from_file(private), TrustedKeys.from_files([public])
    out = tmp_path / "all.bundle"
    assert export_bundle(PlansOnly(signer, PLANS), H200, None, out, signer) == PLANS
    raw, doc = read_bundle(out)
    assert doc.header.entries == PLANS and len(doc.envelope.payload) < 2000  # one subject, whatever the count
    assert len(load_bundle(out, trusted)) == PLANS
    # the file is standard JSON: an entry per line, header and envelope after the entries
    assert out.read_bytes().count(b"\n") == PLANS + 1 and json.loads(out.read_bytes())["header"]["entries"] == PLANS
    small = PlansOnly(signer, 3)
    export_bundle(small, H200, None, tmp_path / "small.bundle", signer)
    dest = open_store(f"sqlite:///{tmp_path / 'dest.db'}", create=True)
    report = import_bundle(dest, tmp_path / "small.bundle", trusted)
    assert report.imported == 3 and report.signature_checked and dest.plan_graph_keys(H200.env_id) == sorted(small.records)


def test_a_bundle_signed_with_the_legacy_statement_still_verifies(tmp_path):
    signer = Signer.from_file(keygen(tmp_path / "keys", "ops")[0])
    export_bundle(PlansOnly(signer, 3), H200, None, tmp_path / "new.bundle", signer)
    plans = load_bundle(tmp_path / "new.bundle", None)
    doc = build_bundle(H200, plans, None)
    doc["envelope"] = signer.envelope(legacy_bundle_statement(doc)).model_dump()
    write_bundle(doc, tmp_path / "legacy.bundle")
    trusted = TrustedKeys([signer.private_key.public_key()])
    assert len(load_bundle(tmp_path / "legacy.bundle", trusted)) == 3
    doc["entries"][0]["blob_b64"] = base64.b64encode(b"evil").decode()
    write_bundle(doc, tmp_path / "tampered.bundle")
    with pytest.raises(SignatureError, match="do not match its signed statement"):
        load_bundle(tmp_path / "tampered.bundle", trusted)


"""Signed bundles of any size (issue 37, finding 4): the signed statement does not grow with the bundle, and export
and import stream one plan at a time.

Figure (this test's 1,000 signed plans, on main 4d1a308): export failed past 72 plans (``Envelope payload String
should have at most 16384 characters``, the statement named every blob); with the fix the 1,000 export, verify and
import, and the envelope's payload is the same size at 1 plan and at 1,000.
"""

from __future__ import annotations

import base64
import json
import re

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



def _big(signer: Signer, n: int, size: int) -> PlansOnly:
    """``n`` plans of blobs of ``size`` bytes each."""
    plans = PlansOnly(signer, n)
    for key, record in list(plans.records.items()):
        blob = key.encode() * (size // 64)
        meta = signer.sign(make_meta(key, H200, blob, revision=record.revision))
        plans.records[key] = PlanRecord.model_validate({**meta.model_dump(), "env_id": H200.env_id,
                                                        "created_at": "2026-01-01T00:00:00Z"})
        plans.blobs[meta.blob_sha256] = blob
    return plans


def test_an_import_reads_a_streamed_bundle_an_entry_at_a_time(tmp_path, monkeypatch):
    """Import read the file whole and parsed it whole (a 1 GiB bundle took several times that in memory); a bundle
    export wrote is read twice an entry at a time: verified, then published. Peak of Python allocations while
    importing 16 plans of 1 MiB (a 21.4 MiB bundle), no trusted keys: main 4d1a308 42.9 MiB, with the fix 13.4 MiB
    (10.5 MiB here, with them).
    """
    import tracemalloc

    from plancache import bundle

    private, public, _ = keygen(tmp_path / "keys", "ops")
    signer, trusted = Signer.from_file(private), TrustedKeys.from_files([public])
    out = tmp_path / "big.bundle"
    export_bundle(_big(signer, 16, 1 << 20), H200, None, out, signer)
    monkeypatch.setattr(bundle, "read_bundle", lambda *a: pytest.fail("read whole"))
    dest = open_store(f"sqlite:///{tmp_path / 'dest.db'}", create=True)
    tracemalloc.start()
    try:
        report = import_bundle(dest, out, trusted)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.imported == 16 and len(dest.plan_graph_keys(H200.env_id)) == 16
    print(f"import of a {out.stat().st_size / 2**20:.1f} MiB bundle: peak {peak / 2**20:.1f} MiB")
    assert peak < 16 * 2**20  # a few entries' worth; the bundle is 21.4 MiB


def test_a_streamed_bundle_edited_in_place_is_refused_whole(tmp_path):
    private, public, _ = keygen(tmp_path / "keys", "ops")
    signer, trusted = Signer.from_file(private), TrustedKeys.from_files([public])
    out = tmp_path / "b.bundle"
    export_bundle(PlansOnly(signer, 3), H200, None, out, signer)
    lines = out.read_bytes().split(b"\n")
    edited = re.sub(rb'"revision":\d+,', b'"revision":99,', lines[2], count=1)  # entry 1's record, the line kept
    assert edited != lines[2]
    lines[2] = edited
    out.write_bytes(b"\n".join(lines))
    dest = open_store(f"sqlite:///{tmp_path / 'dest.db'}", create=True)
    with pytest.raises(SignatureError):
        import_bundle(dest, out, trusted)
    assert dest.plan_graph_keys(H200.env_id) == []

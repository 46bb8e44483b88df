"""Test data defined once (no torch, no server stack): the GPU environments the tests run "on", signing keys, and
the one factory of plan metadata (:func:`make_meta`, :func:`make_record`) that fixtures and fakes build on."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from plancache.environment import Environment
from plancache.protocol import Candidate, CandidateTable, PlanMeta, PlanRecord
from plancache.signing import Signer, TrustedKeys
from plancache.spec import parse_spec

#: The conv→bias→relu example spec (examples/conv_bias_relu.json).
CONV_SPEC = parse_spec((Path(__file__).resolve().parents[1] / "examples" / "conv_bias_relu.json").read_text())

#: The environment of the tests: an H200 with cuDNN 9.19, driver 13.0 and FE 1.32.
H200 = Environment(sm=90, sm_count=132, cudnn_version=91900, driver_version=13000, frontend_version="1.32.0",
                   device_name="NVIDIA H200", cuda_runtime="13.0", torch_version="2.11.0")
#: Another GPU: an H200's plans are not valid on it.
OTHER_GPU = Environment(sm=80, sm_count=108, cudnn_version=91900, driver_version=13000, frontend_version="1.32.0",
                        device_name="NVIDIA A100")

#: A client's request deadline and read timeout in tests that do not test them: a loaded CI machine has taken over
#: the default 5 s to answer a resolve, and to serve 8 parallel GETs of a static index.
PATIENT: dict[str, float] = {"request_deadline": 30.0, "read_timeout": 30.0}


def patient(options: dict[str, Any]) -> dict[str, Any]:
    """A :class:`~plancache.client.PlanCache`'s keyword ``options`` with :data:`PATIENT`'s values for what neither
    they nor their ``settings`` set (a test that sets a deadline, either way, is testing it)."""
    settings = options.get("settings")
    given = set(options) | (settings.model_fields_set if settings is not None else set())
    return {**{k: v for k, v in PATIENT.items() if k not in given}, **options}


def new_signer() -> Signer:
    """A fresh ed25519 :class:`~plancache.signing.Signer` (in memory)."""
    return Signer(Ed25519PrivateKey.generate())


def trusted(*signers: Signer) -> TrustedKeys:
    """The :class:`~plancache.signing.TrustedKeys` of these signers' public keys."""
    return TrustedKeys([s.private_key.public_key() for s in signers])


def make_meta(graph_key: str, env: Environment, blob: bytes = b"serialized-plan", signer: Signer | None = None,
              **overrides: Any) -> PlanMeta:
    """A :class:`~plancache.protocol.PlanMeta` for ``blob`` (its digest and size), fields overridden by ``overrides``,
    then signed by ``signer`` when given."""
    fields: dict[str, Any] = dict(
        graph_key=graph_key, environment=env, blob_sha256=hashlib.sha256(blob).hexdigest(), blob_size=len(blob),
        engine_id=7, knobs={"TILE_M": 2}, plan_name="eng7", workspace_bytes=1024, winner_median_ms=0.05,
        heuristic_median_ms=0.08, worst_median_ms=1.5, tuning_seconds=1.5, worker_id="w-test",
    )
    fields.update(overrides)
    meta = PlanMeta(**fields)
    return signer.sign(meta) if signer is not None else meta


def make_candidates(n: int = 2, **overrides: Any) -> CandidateTable:
    """A candidates table of ``n`` rows: #0 ``ok`` (0.05 ms), then ``build_failed`` ones; ``overrides`` go to the
    table (e.g. ``candidates_omitted``)."""
    rows = [Candidate(index=0, engine_id=7, knobs={"TILE_M": 2}, median_ms=0.05, status="ok"),
            *(Candidate(index=i, engine_id=9, status="build_failed", error="unsupported") for i in range(1, n))]
    return CandidateTable(**{"candidates": rows[:n], **overrides})


def make_record(graph_key: str, env: Environment, blob: bytes = b"serialized-plan", signer: Signer | None = None,
                **overrides: Any) -> PlanRecord:
    """:func:`make_meta` as a stored :class:`~plancache.protocol.PlanRecord` (created now)."""
    meta = make_meta(graph_key, env, blob, signer, **overrides)
    return PlanRecord(**meta.model_dump(), env_id=meta.environment.env_id, created_at=datetime.now(UTC))


def stored_plans(store: Any, env: Environment, graph_keys: list[str], *, include_blobs: bool = True
                 ) -> tuple[dict[str, tuple[PlanRecord, bytes | None]], list[str]]:
    """What ``store`` holds for ``graph_keys`` on ``env``, read as the resolve route reads it (records, then their
    blobs): each stored key's record and blob (None when not asked for, or gone), and the other keys, in order."""
    keys = list(dict.fromkeys(graph_keys))
    records = {key: record for key, (_, record) in store.plan_records(env, keys).items()}
    blobs = store.get_blobs({r.blob_sha256 for r in records.values()}) if include_blobs else {}
    found = {key: (records[key], blobs.get(records[key].blob_sha256)) for key in keys if key in records}
    return found, [key for key in keys if key not in records]

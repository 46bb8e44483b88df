"""Verification of a plan blob before anything deserializes it.

The order is fixed: size → sha256 → signature (when trusted keys are configured) → graph key →
environment. The first failing step raises :class:`~plancache.errors.VerificationError` whose
``reason`` is one of :data:`REASONS`; a blob that raised must never reach ``deserialize``.
"""

from __future__ import annotations

import hashlib

from ..environment import Environment
from ..errors import VerificationError
from ..protocol import PlanMeta
from ..signing import TrustedKeys

#: Every reason a blob is rejected for. ``malformed``: a record or blob that cannot be decoded;
#: ``deserialize``: a verified blob that cuDNN refused to load (counted by the client, not raised here).
REASONS: tuple[str, ...] = ("malformed", "size", "sha256", "unsigned", "unknown_signer", "bad_signature",
                            "graph_key", "environment", "deserialize")


def check_record(record: PlanMeta, *, graph_key: str, environment: Environment, trusted: TrustedKeys | None) -> None:
    """The record-only steps: signature (if ``trusted`` holds keys), graph key, environment.

    A record that passes is authentic and meant for this graph on this GPU, so its
    ``(engine_id, knobs)`` may be rebuilt even when its blob bytes are damaged."""
    if trusted is not None and len(trusted):
        trusted.verify(record)  # SignatureError is a VerificationError: unsigned, unknown_signer, bad_signature
    if record.graph_key != graph_key:
        raise VerificationError("graph_key", f"record is for graph key {record.graph_key[:16]}…, "
                                             f"not the requested {graph_key[:16]}…")
    if record.environment.validity() != environment.validity():
        raise VerificationError("environment", f"plan {graph_key[:12]} was built for {record.environment.describe()}, "
                                               f"this process runs on {environment.describe()}")


def verify_blob(record: PlanMeta, blob: bytes, *, graph_key: str, environment: Environment,
                trusted: TrustedKeys | None) -> None:
    """Raise :class:`VerificationError` unless ``blob`` is exactly what ``record`` describes and
    ``record`` is a trusted plan for ``graph_key`` on ``environment``."""
    if len(blob) != record.blob_size:
        raise VerificationError("size", f"plan {graph_key[:12]}: blob is {len(blob)} bytes, "
                                        f"the record says {record.blob_size}")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != record.blob_sha256:
        raise VerificationError("sha256", f"plan {graph_key[:12]}: blob sha256 is {digest[:16]}…, "
                                          f"the record says {record.blob_sha256[:16]}…")
    check_record(record, graph_key=graph_key, environment=environment, trusted=trusted)

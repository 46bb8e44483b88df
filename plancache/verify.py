"""The one verification of a plan blob against its record, for every place that admits a blob.

The order is fixed: size → sha256 → signature → graph key → environment → revision. Each caller asks
for the steps that apply to it: the client all of them; a bundle entry all but the revision, against its
header's environment and its enclosed spec's key; the worker a tuned blob's size, sha256 and environment; the
server's publish and the worker spool size and sha256 only. The first failing step raises
:class:`~plancache.errors.VerificationError` whose ``reason`` is one of :data:`REASONS`. A withdrawal is checked
the same way, less the blob and the revision (:func:`verify_withdrawal`; its caller compares the revision).
Needs neither torch nor the server stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .digest import sha256_of
from .errors import Reason, VerificationError

if TYPE_CHECKING:  # a record in hand means its modules are loaded: the client imports this one before them
    from .environment import Environment
    from .protocol import PlanMeta, Withdrawal
    from .signing import TrustedKeys

#: The first bytes of FE's blob of a python-engine (CuTe DSL) plan (``cudnn._plan_serdes.MAGIC``, contract-tested):
#: FE loads one only into an empty pygraph, never into a graph that already has nodes.
PYTHON_PLAN_MAGIC = b"CUDNN_FE_PYPLAN\0"


def is_python_plan(blob: bytes) -> bool:
    """Whether ``blob`` is FE's serialized python-engine plan (its header), not a cuDNN backend plan."""
    return blob[:len(PYTHON_PLAN_MAGIC)] == PYTHON_PLAN_MAGIC


#: Every reason a blob is rejected for (:class:`~plancache.errors.Reason`, less ``bad_key``, which is about key files).
REASONS: tuple[Reason, ...] = tuple(r for r in Reason if r is not Reason.BAD_KEY)


def verify_blob(record: PlanMeta, blob: bytes | None, *, what: str, trusted: TrustedKeys | None = None,
                graph_key: str | None = None, environment: Environment | None = None,
                require_signature: bool = False, min_revision: int | None = None) -> None:
    """Raise :class:`VerificationError` (message starting with ``what``) at the first failing step.

    Steps that are not asked for are skipped: size and sha256 when ``blob`` is None (the record alone:
    is it authentic and meant for this graph and GPU?), the signature when ``trusted`` holds no key — unless
    ``require_signature``, when no key means the signature cannot be checked (``no_trusted_keys``) —,
    the graph key and environment when ``graph_key`` / ``environment`` is None, the revision when ``min_revision``
    (the highest revision accepted before for this graph key and environment) is None."""
    if blob is not None:
        if len(blob) != record.blob_size:
            raise VerificationError(Reason.SIZE, f"{what}: blob size {len(blob)} does not match its record's "
                                            f"{record.blob_size} bytes")
        digest = sha256_of(blob)  # read from a blob store: hashed as it was read (plancache.digest)
        if digest != record.blob_sha256:
            raise VerificationError(Reason.SHA256, f"{what}: blob sha256 {digest} does not match its record's "
                                              f"{record.blob_sha256}")
    if trusted:
        trusted.verify(record, what=what)  # SignatureError: unsigned, unknown_signer, bad_signature, malformed
    elif require_signature:
        raise VerificationError(Reason.NO_TRUSTED_KEYS, f"{what}: no trusted keys are configured (PLANCACHE_TRUSTED_KEYS), "
                                                 f"so its signature cannot be verified")
    from .protocol import PlanRecord

    env_id = record.env_id if isinstance(record, PlanRecord) else record.environment.env_id
    _check_target(what, record.graph_key, record.environment, env_id, graph_key, environment)
    if min_revision is not None and record.revision < min_revision:
        raise VerificationError(Reason.REVISION, f"{what}: its record has revision {record.revision}, older than "
                                                f"revision {min_revision} accepted before for this graph and GPU")


def verify_withdrawal(withdrawal: Withdrawal, *, what: str, trusted: TrustedKeys, graph_key: str,
                      environment: Environment) -> None:
    """Raise :class:`VerificationError` unless ``withdrawal`` is signed by a trusted key (none trusted:
    ``no_trusted_keys``; an unsigned withdrawal is never acted on) and names ``graph_key`` on ``environment``."""
    if not trusted:
        raise VerificationError(Reason.NO_TRUSTED_KEYS, f"{what}: no trusted keys are configured (PLANCACHE_TRUSTED_KEYS), "
                                                 f"so its signature cannot be verified")
    trusted.verify_withdrawal(withdrawal, what=what)
    _check_target(what, withdrawal.graph_key, withdrawal.environment, withdrawal.environment.env_id, graph_key,
                  environment)


def _check_target(what: str, key: str, env: Environment, env_id: str, graph_key: str | None,
                  environment: Environment | None) -> None:
    """The graph key and environment steps: a record (or withdrawal) for ``key`` on ``env`` must be for ``graph_key``
    on ``environment`` (a step whose expected value is None is skipped)."""
    if graph_key is not None and key != graph_key:
        raise VerificationError(Reason.GRAPH_KEY, f"{what}: its record is for graph key {key}, expected {graph_key}")
    if environment is not None and (env_id != environment.env_id or env.validity() != environment.validity()):
        raise VerificationError(Reason.ENVIRONMENT, f"{what}: its record is for {env.describe()} (env id {env_id}), "
                                               f"expected {environment.describe()} (env id {environment.env_id})")

"""ed25519 signing of plan records and bundles as DSSE envelopes carrying in-toto statements.

A signed record carries a DSSE envelope (https://github.com/secure-systems-lab/dsse) of payload type
:data:`PAYLOAD_TYPE`, whose payload is an in-toto Statement v1 (https://in-toto.io/Statement/v1): its subject
is the plan blob, named by its graph key (``{"name": GRAPH_KEY, "digest": {"sha256": …}}``), its predicate
the record's graph key, environment validity fields, blob size, ``(engine_id, knobs)``, timings (torch's native
kernels' too, when timed), numerics check, worker id and ``revision`` (:func:`plan_predicate`), plus the signing
time. Each signature is ed25519 over DSSE's pre-authentication encoding (:func:`pae`), so any DSSE verifier
holding the public key checks it; ``keyid`` is the key id (the first 16 hex characters of the sha256 of the raw
public key). A record is authentic only when a trusted key's signature verifies and the record's fields equal the
statement's (:meth:`TrustedKeys.verify`). Bundles are signed the same way (:mod:`plancache.bundle`), and so are withdrawals
(:class:`~plancache.protocol.Withdrawal`, predicate :data:`WITHDRAWAL_PREDICATE`: the same subject, the graph key,
environment, withdrawn revision, reason and the withdrawal's own revision, :func:`withdrawal_predicate`).

The server stores envelopes but holds no private key; clients verify against trusted public keys, and several
trusted keys at once allow rotation (docs/DESIGN.md, "Signatures, revisions and key rotation").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .canonical import canonical_json
from .errors import InvalidValue, Reason, SignatureError
from .files import atomic_write, read_limited
from .protocol import DsseSignature, Envelope, PlanMeta, Withdrawal
from .validation import INT64_MAX

log = logging.getLogger("plancache.signing")

#: The DSSE payload type of an in-toto statement.
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
#: The predicate types of a plan record's, a bundle's and a withdrawal's statement.
PLAN_PREDICATE = "https://plancache.dev/plan/v1"
BUNDLE_PREDICATE = "https://plancache.dev/bundle/v1"
WITHDRAWAL_PREDICATE = "https://plancache.dev/withdrawal/v1"
#: The name records signed by earlier releases gave every plan statement's subject (still verified); a plan's
#: subject is named by its graph key now.
LEGACY_PLAN_SUBJECT = "plan blob"
#: The most a key file is read for: an ed25519 key's PEM is about 120 bytes (``keygen`` writes it), so a larger
#: file is another one named by mistake (``/dev/zero`` is refused too, not read until memory runs out).
MAX_KEY_FILE_BYTES = 64 * 1024


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding, the bytes a signature covers:
    ``"DSSEv1" SP len(type) SP type SP len(body) SP body`` (lengths in ASCII decimal, of the UTF-8 bytes)."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def subjects(artifacts: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
    """A statement's ``subject`` list for ``(name, sha256)`` pairs."""
    return [{"name": name, "digest": {"sha256": sha}} for name, sha in artifacts]


def statement(artifacts: Iterable[tuple[str, str]], predicate_type: str, predicate: dict[str, Any]) -> dict[str, Any]:
    """An in-toto Statement v1 about ``artifacts`` (``(name, sha256)`` pairs)."""
    return {"_type": STATEMENT_TYPE, "subject": subjects(artifacts), "predicateType": predicate_type,
            "predicate": predicate}


def plan_predicate(meta: PlanMeta) -> dict[str, Any]:
    """The fields of ``meta`` its statement's predicate signs (the predicate adds ``signed_at``, the signing time).
    ``native_median_ms`` is in it only when it holds a timing: a record without one has the predicate of a release
    that lacks the field, so the records such a release signed verify unchanged."""
    predicate: dict[str, Any] = {
        "graph_key": meta.graph_key,
        "environment": meta.environment.validity(),
        "blob_size": meta.blob_size,
        "engine_id": meta.engine_id,
        "knobs": dict(sorted(meta.knobs.items())),
        "winner_median_ms": meta.winner_median_ms,
        "heuristic_median_ms": meta.heuristic_median_ms,
        "numerics_check": meta.numerics_check,
        "worker_id": meta.worker_id,
        "revision": meta.revision,
    }
    if meta.native_median_ms:
        predicate["native_median_ms"] = dict(sorted(meta.native_median_ms.items()))
    return predicate


def _stamp(signed_at: datetime) -> str:
    return signed_at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def plan_statement(meta: PlanMeta, signed_at: datetime) -> dict[str, Any]:
    """The statement a signed ``meta`` carries."""
    return statement([(meta.graph_key, meta.blob_sha256)], PLAN_PREDICATE,
                     {**plan_predicate(meta), "signed_at": _stamp(signed_at)})


def withdrawal_predicate(w: Withdrawal) -> dict[str, Any]:
    """The fields of ``w`` its statement's predicate signs (plus ``signed_at``); the subject is the withdrawn blob."""
    return {
        "graph_key": w.graph_key,
        "environment": w.environment.validity(),
        "withdrawn_revision": w.withdrawn_revision,
        "reason": w.reason,
        "revision": w.revision,
    }


def withdrawal_statement(w: Withdrawal, signed_at: datetime) -> dict[str, Any]:
    """The statement a signed withdrawal carries."""
    return statement([(w.graph_key, w.blob_sha256)], WITHDRAWAL_PREDICATE,
                     {**withdrawal_predicate(w), "signed_at": _stamp(signed_at)})


#: How far ahead of a clock a revision may be, in milliseconds (revisions are milliseconds since the epoch): a day,
#: where clocks differ by seconds. Further ahead, a revision would hold off every later one of its key for as long (at
#: the last revision there is: for good): a worker does not sign above a claim's ``min_revision`` that far ahead, and
#: a client's cache folder ignores a stored revision that far ahead (a planted file).
MAX_REVISION_LEAD_MS = 24 * 3600 * 1000


class _Revisions:
    """This process's revision clock (see :func:`next_revision`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next(self, after: int) -> int:
        with self._lock:
            if after >= INT64_MAX:
                raise InvalidValue(f"no revision above {after}: revisions end at {INT64_MAX}")
            # above this process's last one while that fits: one revision at the end must not refuse every later one
            last = self._last + 1 if self._last < INT64_MAX else 0
            revision = max(time.time_ns() // 1_000_000, last, after + 1)
            self._last = max(self._last, revision)
            return revision


_REVISIONS = _Revisions()


def next_revision(after: int = 0) -> int:
    """A new revision: the time in milliseconds since the epoch, raised as needed to stay above ``after`` and
    above every revision this process made before."""
    return _REVISIONS.next(after)


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class Signer:
    private_key: Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.private_key.public_key())

    def sign(self, meta: PlanMeta, *, now: datetime | None = None) -> PlanMeta:
        """``meta`` with a new ``revision`` (:func:`next_revision`: above its own) and the ``envelope`` signing it."""
        meta = meta.model_copy(update={"revision": next_revision(meta.revision), "envelope": None})
        return meta.model_copy(update={"envelope": self.envelope(plan_statement(meta, now or datetime.now(UTC)))})

    def sign_withdrawal(self, w: Withdrawal, *, now: datetime | None = None) -> Withdrawal:
        """``w`` with a new ``revision`` (:func:`next_revision`: above the withdrawn one's) and the ``envelope``
        signing it."""
        w = w.model_copy(update={"revision": next_revision(w.withdrawn_revision), "envelope": None})
        return w.model_copy(update={"envelope": self.envelope(withdrawal_statement(w, now or datetime.now(UTC)))})

    def envelope(self, signed: dict[str, Any]) -> Envelope:
        """The DSSE envelope of the in-toto statement ``signed``, signed by this key."""
        payload = canonical_json(signed).encode()
        sig = base64.b64encode(self.private_key.sign(pae(PAYLOAD_TYPE, payload))).decode()
        return Envelope(payloadType=PAYLOAD_TYPE, payload=base64.b64encode(payload).decode(),
                        signatures=[DsseSignature(keyid=self.key_id, sig=sig)])

    @classmethod
    def from_file(cls, path: Path | str) -> Signer:
        """The key of a PEM file (``keygen`` writes it owner-only); one that others may read is used, with a
        warning saying so. Readable by a group of this process only (a Kubernetes secret mounted with ``fsGroup`` and
        mode 0440: owned by root) counts as owner-only. A file over :data:`MAX_KEY_FILE_BYTES` is an ``OSError``
        (``EFBIG``), as an unreadable one."""
        path = Path(path)
        data = read_limited(path, MAX_KEY_FILE_BYTES)
        st = path.stat()
        mode = st.st_mode
        own_group = st.st_gid == os.getegid() or st.st_gid in os.getgroups()
        if mode & (0o007 if own_group else 0o077):
            log.warning("signing key %s can be read by users other than its owner (mode %o): anyone who reads it "
                        "can sign plans your clients trust; make it owner-only (chmod 600)", path, mode & 0o777)
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # TypeError: an encrypted key
            raise SignatureError(Reason.BAD_KEY, f"{path}: not a PEM private key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError(Reason.BAD_KEY, f"{path}: not an ed25519 private key")
        return cls(key)


class TrustedKeys:
    """The public keys a client accepts signatures from, by key id."""

    def __init__(self, keys: list[Ed25519PublicKey]) -> None:
        self._keys = {key_id(k): k for k in keys}

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    @classmethod
    def from_files(cls, paths: Iterable[Path | str]) -> TrustedKeys:
        """The keys of ``paths``: PEM public key files, and folders of them (their ``*.pub`` files). A folder that
        holds no ``*.pub`` (an unpopulated mount, keys named ``*.pem``) is a :class:`SignatureError` (``bad_key``)
        naming it, never "no key from there"; a file over :data:`MAX_KEY_FILE_BYTES` an ``OSError`` (``EFBIG``)."""
        files: list[Path] = []
        for folder_or_file in map(Path, paths):
            found = sorted(folder_or_file.glob("*.pub")) if folder_or_file.is_dir() else [folder_or_file]
            if not found:
                raise _names_no_key(folder_or_file)
            files += found
        keys = []
        for path in files:
            data = read_limited(path, MAX_KEY_FILE_BYTES)
            try:
                key = serialization.load_pem_public_key(data)
            except (ValueError, UnsupportedAlgorithm) as exc:
                raise SignatureError(Reason.BAD_KEY, f"{path}: not a PEM public key: {exc}") from exc
            if not isinstance(key, Ed25519PublicKey):
                raise SignatureError(Reason.BAD_KEY, f"{path}: not an ed25519 public key")
            keys.append(key)
        return cls(keys)

    @classmethod
    def from_setting(cls, value: str | None) -> TrustedKeys:
        """``PLANCACHE_TRUSTED_KEYS``: public key files (or folders of ``*.pub``) separated by ``,`` or ``:``; empty
        or None: no keys (a value of separators alone names no key: :meth:`from_files`' error)."""
        if not value:
            return cls([])
        parts = [part.strip() for part in value.replace(os.pathsep, ",").split(",") if part.strip()]
        if not parts:
            raise _names_no_key(repr(value))
        return cls.from_files(parts)

    def open(self, envelope: Envelope | None, predicate_type: str, *, what: str) -> dict[str, Any]:
        """The in-toto statement in ``envelope``, once a trusted key's signature of it verifies; raises
        :class:`SignatureError` (naming ``what``): ``unsigned`` (no envelope), ``unknown_signer`` (no signature by
        a trusted key id), ``bad_signature`` (none of those verifies), ``malformed`` (a verified payload that is not
        a statement of ``predicate_type``)."""
        if envelope is None:
            raise SignatureError(Reason.UNSIGNED, f"{what} is unsigned")
        try:
            payload = base64.b64decode(envelope.payload, validate=True)
        except binascii.Error as exc:
            raise SignatureError(Reason.MALFORMED, f"{what}: the envelope's payload is not base64: {exc}") from None
        ours = [s for s in envelope.signatures if s.keyid in self._keys]
        if not ours:
            raise SignatureError(Reason.UNKNOWN_SIGNER, f"{what} signed by unknown key "
                                                   f"{', '.join(s.keyid for s in envelope.signatures)}")
        message = pae(envelope.payloadType, payload)
        if not any(self._verifies(self._keys[s.keyid], s.sig, message) for s in ours):
            raise SignatureError(Reason.BAD_SIGNATURE, f"{what}: signature does not verify")
        try:
            signed = json.loads(payload, object_pairs_hook=_unique_keys)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            raise SignatureError(Reason.MALFORMED, f"{what}: the signed payload is not JSON with unique keys: {exc}") from None
        if (envelope.payloadType != PAYLOAD_TYPE or not isinstance(signed, dict) or signed.get("_type") != STATEMENT_TYPE
                or signed.get("predicateType") != predicate_type or not isinstance(signed.get("predicate"), dict)
                or not isinstance(signed.get("subject"), list)):
            raise SignatureError(Reason.MALFORMED, f"{what}: the signed payload is not an in-toto statement "
                                              f"({STATEMENT_TYPE}, payload type {PAYLOAD_TYPE}) of {predicate_type}")
        return signed

    @staticmethod
    def _verifies(key: Ed25519PublicKey, sig: str, message: bytes) -> bool:
        try:
            key.verify(base64.b64decode(sig, validate=True), message)
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True

    def verify(self, meta: PlanMeta, *, what: str | None = None) -> None:
        """Raise :class:`SignatureError` (naming ``what``, default the plan) unless ``meta``'s envelope verifies by
        a trusted key (:meth:`open`) and its statement says what ``meta`` says: subject the blob's sha256,
        predicate equal to :func:`plan_predicate` (``bad_signature`` naming the fields that differ)."""
        self._check(meta.envelope, PLAN_PREDICATE, plan_predicate(meta), meta.blob_sha256,
                    (meta.graph_key, LEGACY_PLAN_SUBJECT), what=what or f"plan {meta.graph_key[:12]}")

    def verify_withdrawal(self, w: Withdrawal, *, what: str) -> None:
        """As :meth:`verify`, for a withdrawal: its envelope verifies by a trusted key and its statement says what
        ``w`` says (subject the withdrawn blob, predicate :func:`withdrawal_predicate`)."""
        self._check(w.envelope, WITHDRAWAL_PREDICATE, withdrawal_predicate(w), w.blob_sha256, (w.graph_key,),
                    what=what)

    def _check(self, envelope: Envelope | None, predicate_type: str, expected: dict[str, Any], blob_sha256: str,
               names: tuple[str, ...], *, what: str) -> None:
        """Open ``envelope`` (:meth:`open`) and compare its predicate (less ``signed_at``) with ``expected`` and its
        subject with the blob ``blob_sha256`` under one of ``names`` (the first is the graph key)."""
        signed = self.open(envelope, predicate_type, what=what)
        predicate = {k: v for k, v in signed["predicate"].items() if k != "signed_at"}
        differ = sorted(k for k in expected.keys() | predicate.keys() if k not in expected or k not in predicate
                        or expected[k] != predicate[k])
        subject = signed["subject"]
        if subject not in [subjects([(name, blob_sha256)]) for name in names]:
            one = subject[0] if len(subject) == 1 and isinstance(subject[0], dict) else {}
            if one.get("digest") == {"sha256": blob_sha256}:  # the blob is right, its name is another graph's
                differ = sorted({*differ, "graph_key"})
            else:
                differ.insert(0, "blob_sha256")
        if differ:
            raise SignatureError(Reason.BAD_SIGNATURE, f"{what}: the record does not match its signed statement "
                                                  f"({', '.join(differ)})")


def _names_no_key(named: object) -> SignatureError:
    return SignatureError(Reason.BAD_KEY, f"{named} names no public key: give .pub files (`plancache keygen` writes "
                                          "them) or folders holding them")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: a consumer that keeps the first of a repeated key would read another
    statement than one that keeps the last, so a signed payload with one is refused."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def keygen(directory: Path | str, name: str = "plancache") -> tuple[Path, Path, str]:
    """Write ``NAME.key`` (private, mode 0600) and ``NAME.pub`` into ``directory``; return paths and key id."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    priv, pub = directory / f"{name}.key", directory / f"{name}.pub"
    if priv.exists() or pub.exists():
        raise FileExistsError(f"{priv} or {pub} already exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = serialization.Encoding.PEM
    atomic_write(priv, key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
                 mode=0o600, exclusive=True)
    atomic_write(pub, key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
                 mode=0o644, exclusive=True)
    return priv, pub, key_id(key.public_key())

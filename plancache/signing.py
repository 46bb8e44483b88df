"""ed25519 signing of plan statements.

A worker signs a canonical statement binding the graph key, the environment's validity
fields, the blob's sha256 and size and the winning ``(engine_id, knobs)``. The server
stores the signature but holds no private key; clients verify against trusted public keys.
Key ids (the first 16 hex chars of the sha256 of the raw public key) allow rotation.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import SignatureError
from .protocol import PlanMeta

STATEMENT_VERSION = 1


def statement(meta: PlanMeta) -> bytes:
    """The canonical bytes a signature covers."""
    body = {
        "v": STATEMENT_VERSION,
        "graph_key": meta.graph_key,
        "environment": meta.environment.validity(),
        "blob_sha256": meta.blob_sha256,
        "blob_size": meta.blob_size,
        "engine_id": meta.engine_id,
        "knobs": dict(sorted(meta.knobs.items())),
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class Signer:
    private_key: Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.private_key.public_key())

    def sign(self, meta: PlanMeta) -> PlanMeta:
        """Return ``meta`` with ``signature`` and ``signer_key_id`` set."""
        return meta.model_copy(update={"signature": self.sign_bytes(statement(meta)), "signer_key_id": self.key_id})

    def sign_bytes(self, message: bytes) -> str:
        """The base64 ed25519 signature of ``message`` (for documents other than plan statements)."""
        return base64.b64encode(self.private_key.sign(message)).decode()

    @classmethod
    def from_file(cls, path: Path | str) -> "Signer":
        data = Path(path).read_bytes()
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except ValueError as exc:
            raise SignatureError("bad_key", f"{path}: not a PEM private key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError("bad_key", f"{path}: not an ed25519 private key")
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
    def from_files(cls, paths: list[Path | str]) -> "TrustedKeys":
        keys = []
        for path in paths:
            data = Path(path).read_bytes()
            try:
                key = serialization.load_pem_public_key(data)
            except ValueError as exc:
                raise SignatureError("bad_key", f"{path}: not a PEM public key: {exc}") from exc
            if not isinstance(key, Ed25519PublicKey):
                raise SignatureError("bad_key", f"{path}: not an ed25519 public key")
            keys.append(key)
        return cls(keys)

    @classmethod
    def from_setting(cls, value: str | None) -> "TrustedKeys":
        """``PLANCACHE_TRUSTED_KEYS``: public key files (or folders of ``*.pub``) separated by ``,`` or ``:``."""
        if not value:
            return cls([])
        paths: list[Path | str] = []
        for part in value.replace(os.pathsep, ",").split(","):
            part = part.strip()
            if not part:
                continue
            p = Path(part)
            paths.extend(sorted(p.glob("*.pub")) if p.is_dir() else [p])
        return cls.from_files(paths)

    def verify(self, meta: PlanMeta, *, what: str | None = None) -> None:
        """Raise :class:`SignatureError` (naming ``what``, default the plan) unless ``meta`` carries a valid
        signature by a trusted key."""
        self.verify_bytes(statement(meta), meta.signature, meta.signer_key_id, what=what or f"plan {meta.graph_key[:12]}")

    def verify_bytes(self, message: bytes, signature: str | None, signer_key_id: str | None, *, what: str) -> None:
        """Raise :class:`SignatureError` (naming ``what``) unless ``signature`` is a trusted key's signature of ``message``."""
        if not signature or not signer_key_id:
            raise SignatureError("unsigned", f"{what} is unsigned")
        key = self._keys.get(signer_key_id)
        if key is None:
            raise SignatureError("unknown_signer", f"{what} signed by unknown key {signer_key_id}")
        try:
            key.verify(base64.b64decode(signature, validate=True), message)
        except (InvalidSignature, ValueError) as exc:
            raise SignatureError("bad_signature", f"{what}: signature does not verify") from exc


def keygen(directory: Path | str, name: str = "plancache") -> tuple[Path, Path, str]:
    """Write ``NAME.key`` (private, mode 0600) and ``NAME.pub`` into ``directory``; return paths and key id."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    priv, pub = directory / f"{name}.key", directory / f"{name}.pub"
    if priv.exists() or pub.exists():
        raise FileExistsError(f"{priv} or {pub} already exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub, key_id(key.public_key())

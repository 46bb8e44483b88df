"""What a command reads from its user: spec files, an environment, signing and trusted keys, an output folder; a
problem names the file or the option and says what to give instead."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PlanCacheError, SignatureError
from ..files import read_limited, too_large
from ..settings import DEFAULT_MAX_JSON_BYTES, env_name
from .failures import ExitCode, Failure

if TYPE_CHECKING:
    from ..environment import Environment
    from ..signing import Signer, TrustedKeys
    from ..spec import GraphSpec


def writable_folder(path: Path, what: str, fix: str) -> Path:
    """``path``, created if needed and checked writable (by writing a file), else an OS_ERROR failure."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise Failure(f"cannot write {what} {path}: {exc.strerror or exc}", fix, ExitCode.OS_ERROR) from None
    return path


def _unreadable(path: Path, what: str, exc: OSError) -> Failure:
    return Failure(f"cannot read the {what} {path}: {exc.strerror or exc}",
                   "check the path (spec files are GraphSpec JSON, e.g. examples/*.json)", ExitCode.OS_ERROR)


def read_spec_file(path: Path, limit: int = DEFAULT_MAX_JSON_BYTES, what: str = "spec file") -> bytes:
    """The bytes of a spec file (or of a ``what`` that may be one), at most ``limit``; a problem names the file."""
    try:
        return read_limited(path, limit)
    except OSError as exc:
        raise _unreadable(path, what, exc) from None


def load_spec_file(path: Path, data: bytes | None = None) -> GraphSpec:
    """Read (unless its bytes are given) and validate a spec file; a problem names the file."""
    from ..spec import parse_spec

    if data is None:
        data = read_spec_file(path)
    elif len(data) > DEFAULT_MAX_JSON_BYTES:  # read under a larger limit (enqueue's, for a capture file)
        raise _unreadable(path, "spec file", too_large(path, len(data), DEFAULT_MAX_JSON_BYTES))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Failure(f"{path} is not a GraphSpec JSON file (not UTF-8 text)",
                      "give a GraphSpec JSON document (docs/SPEC.md), e.g. examples/conv_bias_relu.json",
                      ExitCode.USAGE) from None
    try:
        return parse_spec(text)
    except PlanCacheError as exc:
        raise Failure(f"{path}: {exc.message}", "fix the spec (docs/SPEC.md)", ExitCode.FAILED) from None


def load_environment(value: str, option: str) -> Environment:
    """An :class:`Environment` from inline JSON (``{...}``) or a JSON file."""
    from pydantic import ValidationError

    from ..environment import Environment
    from ..validation import validation_message

    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = read_limited(value, DEFAULT_MAX_JSON_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise Failure(f"{option} {value}: cannot read the environment file: {getattr(exc, 'strerror', None) or exc}",
                          f"give {option} an environment JSON file or inline JSON", ExitCode.USAGE) from None
    try:
        return Environment.model_validate_json(text)
    except ValidationError as exc:
        raise Failure(f"{option} {value[:80]}: not an environment ({validation_message(exc.errors(), 1)})",
                      "give the environment JSON of a plan record (`plancache plans list --json`, its "
                      "\"environment\")", ExitCode.USAGE) from None


def load_signer(path: Path, option: str = "--signing-key") -> Signer:
    """The ed25519 signer in ``path``; a missing or bad key file names the path and the setting."""
    from ..signing import Signer

    variable = env_name("signing_key")
    try:
        return Signer.from_file(path)
    except OSError as exc:
        raise Failure(f"cannot read the signing key {path}: {exc.strerror or exc}",
                      f"check {option} / {variable}, or create a key pair with `plancache keygen`",
                      ExitCode.OS_ERROR) from None
    except SignatureError as exc:
        raise Failure(exc.message, f"give {option} / {variable} the NAME.key file `plancache keygen` wrote",
                      ExitCode.FAILED) from None


def load_trusted_keys(value: str | None, option: str = "--trusted-keys") -> TrustedKeys:
    """The public keys ``value`` names (files or folders of ``*.pub``, ``,`` or ``:`` separated; None: none);
    an unreadable one, one that is no ed25519 public key, or a folder that holds none, is a :class:`Failure` naming
    the option and the setting."""
    from ..signing import TrustedKeys

    variable = env_name("trusted_keys")
    try:
        return TrustedKeys.from_setting(value)
    except OSError as exc:
        raise Failure(f"cannot read the trusted keys {value!r}: {exc.strerror or exc} ({exc.filename})",
                      f"check {option} / {variable}", ExitCode.OS_ERROR) from None
    except SignatureError as exc:
        raise Failure(f"{option}: {exc.message}", f"check {option} / {variable}", ExitCode.FAILED) from None

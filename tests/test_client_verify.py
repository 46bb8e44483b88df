"""Blob verification: each failure has its reason, and the steps run in the documented order."""

from __future__ import annotations

import base64

import pytest

from plancache.errors import VerificationError
from plancache.client.verify import check_record, verify_blob
from plancache.signing import TrustedKeys
from tests.client_fakes import H200, OTHER_GPU, make_meta, new_signer, trusted

KEY = "a" * 64
OTHER_KEY = "b" * 64
BLOB = b"\x00serialized-cudnn-plan\xff" * 10


@pytest.fixture(scope="module")
def signer():
    return new_signer()


def reason(meta, blob=BLOB, *, key=KEY, env=H200, keys=None) -> str | None:
    try:
        verify_blob(meta, blob, graph_key=key, environment=env, trusted=keys)
    except VerificationError as exc:
        return exc.reason
    return None


def test_a_good_signed_blob_passes(signer):
    assert reason(make_meta(KEY, H200, BLOB, signer), keys=trusted(signer)) is None


def test_without_trusted_keys_the_digest_is_still_checked():
    assert reason(make_meta(KEY, H200, BLOB)) is None
    assert reason(make_meta(KEY, H200, BLOB), keys=TrustedKeys([])) is None
    corrupted = BLOB[:5] + bytes([BLOB[5] ^ 1]) + BLOB[6:]
    assert reason(make_meta(KEY, H200, BLOB), corrupted) == "sha256"


@pytest.mark.parametrize("case, expected", [
    ("truncated", "size"),
    ("corrupted_byte", "sha256"),
    ("unsigned", "unsigned"),
    ("unknown_signer", "unknown_signer"),
    ("bad_signature", "bad_signature"),
    ("other_graph", "graph_key"),
    ("other_environment", "environment"),
])
def test_each_failure_names_its_reason(signer, case, expected):
    keys = trusted(signer)
    meta, blob, key = make_meta(KEY, H200, BLOB, signer), BLOB, KEY
    if case == "truncated":
        blob = BLOB[:-1]
    elif case == "corrupted_byte":
        blob = BLOB[:-1] + bytes([BLOB[-1] ^ 0x40])
    elif case == "unsigned":
        meta = make_meta(KEY, H200, BLOB)
    elif case == "unknown_signer":
        meta = make_meta(KEY, H200, BLOB, new_signer())
    elif case == "bad_signature":
        sig = bytearray(base64.b64decode(meta.signature))
        sig[0] ^= 1
        meta = meta.model_copy(update={"signature": base64.b64encode(bytes(sig)).decode()})
    elif case == "other_graph":
        key = OTHER_KEY
    elif case == "other_environment":
        meta = make_meta(KEY, OTHER_GPU, BLOB, signer)
    assert reason(meta, blob, key=key, keys=keys) == expected


def test_a_signature_over_other_fields_does_not_verify(signer):
    """The signature covers the engine config: changing the knobs after signing is caught."""
    meta = make_meta(KEY, H200, BLOB, signer).model_copy(update={"knobs": {"TILE_M": 3}})
    assert reason(meta, keys=trusted(signer)) == "bad_signature"


def test_steps_run_in_order(signer):
    keys = trusted(signer)
    # Everything wrong at once: size is reported first.
    everything = make_meta(OTHER_KEY, OTHER_GPU, BLOB + b"x")
    assert reason(everything, BLOB, keys=keys) == "size"
    # Right size, wrong digest, unsigned, other key and env: sha256 comes before the signature.
    assert reason(make_meta(OTHER_KEY, OTHER_GPU, b"y" * len(BLOB)), keys=keys) == "sha256"
    # Intact blob, unsigned, other graph and env: the signature comes before the graph key.
    assert reason(make_meta(OTHER_KEY, OTHER_GPU, BLOB), keys=keys) == "unsigned"
    # Signed, other graph and env: graph key before environment.
    assert reason(make_meta(OTHER_KEY, OTHER_GPU, BLOB, signer), keys=keys) == "graph_key"


def test_check_record_skips_the_blob_checks(signer):
    """An authentic record with a damaged blob passes check_record (so its engine config may be rebuilt)."""
    meta = make_meta(KEY, H200, BLOB, signer)
    check_record(meta, graph_key=KEY, environment=H200, trusted=trusted(signer))
    with pytest.raises(VerificationError) as exc:
        check_record(meta, graph_key=KEY, environment=OTHER_GPU, trusted=trusted(signer))
    assert exc.value.reason == "environment"

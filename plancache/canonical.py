"""Canonical JSON: the one serialization whose bytes are hashed or signed (graph keys, environment ids,
signed statements and bundles, job target keys)."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(obj: Any) -> str:
    """``obj`` as JSON with sorted keys and no whitespace; non-ASCII characters as themselves (hash or sign its
    UTF-8 encoding); NaN and the infinities refused (``ValueError``)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

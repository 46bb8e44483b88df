"""A pool task module that records, when it is imported, a variable an ``OrderedPool(environ=...)`` sets (as
CUDA reads ``CUDA_VISIBLE_DEVICES`` when it starts): tests/unit/test_multi_device.py."""

from __future__ import annotations

import os

#: The variable's value when this module was imported in the pool process.
SEEN_AT_IMPORT = os.environ.get("PLANCACHE_TEST_PIN")


def seen_at_import(_: object) -> str | None:
    return SEEN_AT_IMPORT

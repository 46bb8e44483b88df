"""Which cuDNN library a handle may be created through with the GIL released (plancache.gpu.runtime)."""

from __future__ import annotations

import pytest

pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")

from plancache.gpu.runtime import loaded_cudnn  # noqa: E402

SITE = "/venv/lib/python3.12/site-packages/nvidia/cudnn/lib"


def _line(path: str) -> str:
    return f"7f2a1c000000-7f2a1c200000 r-xp 00000000 fd:01 1234567                    {path}\n"


def test_the_one_cudnn_library_mapped_is_found_among_its_sub_libraries():
    maps = [_line(f"{SITE}/libcudnn.so.9"), _line(f"{SITE}/libcudnn.so.9"), _line(f"{SITE}/libcudnn_graph.so.9"),
            _line(f"{SITE}/libcudnn_engines_precompiled.so.9"), _line("/usr/lib/libc.so.6"),
            "7ffd4a1f0000-7ffd4a211000 rw-p 00000000 00:00 0                          [stack]\n",
            "7f2a1c400000-7f2a1c401000 rw-p 00000000 00:00 0 \n"]
    assert loaded_cudnn(maps) == f"{SITE}/libcudnn.so.9"


def test_no_cudnn_or_two_copies_of_it_give_none():
    assert loaded_cudnn([_line(f"{SITE}/libcudnn_graph.so.9"), _line("/usr/lib/libc.so.6")]) is None
    assert loaded_cudnn([_line(f"{SITE}/libcudnn.so.9"), _line("/opt/torch/lib/libcudnn.so.9")]) is None
    assert loaded_cudnn([]) is None

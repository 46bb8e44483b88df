"""Python-engine (CuTe DSL) plans, on the CPU against FE 1.32's own blob format (``cudnn._plan_serdes``): FE loads
one only into an empty pygraph, so the tuner never builds one and a client refuses one by its header, counted, never
deserializing nor rebuilding it (each load was a cuDNN refusal and a local rebuild; replay-only mode a PlanMiss)."""

from __future__ import annotations

import json
from typing import Any

import pytest

cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

from cudnn import _plan_serdes  # noqa: E402

from plancache.client import PlanCache  # noqa: E402
from plancache.errors import PlanMiss  # noqa: E402
from plancache.gpu.fegraph import decode  # noqa: E402
from plancache.spec import parse_spec  # noqa: E402
from plancache.verify import PYTHON_PLAN_MAGIC, is_python_plan  # noqa: E402
from tests.client_fakes import RecordingBackend  # noqa: E402
from tests.factories import CONV_SPEC, H200, make_record, new_signer, trusted  # noqa: E402

#: FE's engine id of its SDPA forward prefill python engine block (``cudnn.engines.engine_ids``).
SDPA_PREFILL_ENGINE = 20_500


def python_plan_blob(spec: Any) -> bytes:
    """A blob in FE 1.32's python-engine format, its graph encoded by FE's own serializer (``_encode_graph``) from
    the spec's decoded pygraph: what ``pygraph.serialize`` writes for a built python-engine plan, less kernels."""
    header = {"format": _plan_serdes.FORMAT, "frontend_version": str(cudnn.__version__),
              "graph": _plan_serdes._encode_graph(decode(spec)),
              "plan": {"engine_id": SDPA_PREFILL_ENGINE, "engine_name": "sdpa_fwd_prefill", "knobs": []}, "kernels": []}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return _plan_serdes.MAGIC + _plan_serdes._LEN.pack(len(text)) + text


def test_the_header_is_fes_own():
    spec = parse_spec(CONV_SPEC).canonical_document()
    blob = python_plan_blob(spec)
    assert PYTHON_PLAN_MAGIC == _plan_serdes.MAGIC
    assert is_python_plan(blob) and _plan_serdes.is_python_plan(blob)
    assert not is_python_plan(b"\x00" * 64) and not is_python_plan(b"CUDNN_FE") and not is_python_plan(b"")


def seeded(tmp_path, mode: str) -> tuple[PlanCache, Any, bytes]:
    signer = new_signer()
    spec = parse_spec(CONV_SPEC)
    blob = python_plan_blob(spec.canonical_document())
    cache = PlanCache("", backend=RecordingBackend(), cache_dir=tmp_path, trusted_keys=trusted(signer), mode=mode)
    cache.disk.save(make_record(spec.graph_key, H200, blob, signer, engine_id=SDPA_PREFILL_ENGINE), blob)
    return cache, spec, blob


def test_a_python_engine_plan_is_refused_by_its_header_counted_and_never_rebuilt(tmp_path):
    cache, spec, _ = seeded(tmp_path, "normal")
    for _ in range(2):
        plan = cache.plan(spec)
    assert plan.source == "heuristic"
    backend = cache._backend
    assert backend.deserialized == []  # never handed to cuDNN / FE
    assert [op for op, _ in backend.calls] == ["heuristic_dynamic"]  # no rebuild of the python engine's config
    assert cache.stats().rejects == {"python_engine": 1}


@pytest.mark.parametrize("mode", ["strict", "replay_only"])
def test_strict_modes_say_why_a_python_engine_plan_is_a_miss(tmp_path, mode):
    cache, spec, _ = seeded(tmp_path, mode)
    with pytest.raises(PlanMiss, match=r"disk: rejected \(python_engine\)"):
        cache.plan(spec)
    assert cache._backend.deserialized == []


def test_the_tuner_records_a_python_engine_candidate_unbuilt():
    pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
    from plancache.gpu.candidates import PYTHON_ENGINE_REFUSED, build_serialized

    class Planned:
        """A prepared graph whose candidate 0 is a python engine and 1 a backend engine."""

        built: list[int] = []

        def get_engine_and_knobs_at_index(self, i: int) -> tuple[int, dict[Any, int]]:
            return (SDPA_PREFILL_ENGINE, {}) if i == 0 else (7, {})

        def get_plan_name_at_index(self, i: int) -> str:
            return f"plan{i}"

        def build_plan_at_index(self, i: int) -> None:
            self.built.append(i)

        def get_workspace_size_plan_at_index(self, i: int) -> int:
            return 0

        def serialize(self, as_bytes: bool) -> bytes:
            return b"backend-plan"

    g = Planned()
    python, backend = build_serialized(g, 0), build_serialized(g, 1)
    assert python.blob is None and python.error == PYTHON_ENGINE_REFUSED and python.engine_id == SDPA_PREFILL_ENGINE
    assert backend.blob == b"backend-plan" and g.built == [1]  # the python engine was never built (compiled)

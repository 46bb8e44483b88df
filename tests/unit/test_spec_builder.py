"""SpecBuilder: the keys of every spec it writes across the repository are pinned (no GPU, no FE).

``tests/data/builder_keys.json`` was recorded from the schema-1 implementation of the builder (it converted
an op list into the schema-2 document); the builder that writes schema 2 directly must give the same keys,
or every stored plan of those graphs would be orphaned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from plancache.spec import GraphSpec, SpecBuilder, graph_key, parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "builder_keys.json"


def _readme_spec() -> GraphSpec:
    """The builder example of README's "Graph specs" section, run as written."""
    section = (ROOT / "README.md").read_text().split("## Graph specs", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    scope: dict[str, object] = {}
    exec(code.group(1), scope)  # noqa: S102 - the README's own example
    spec = scope["spec"]
    assert isinstance(spec, GraphSpec)
    return spec


def _huge_relu() -> GraphSpec:
    """tests/integration/test_gpu_core.py's spec larger than the device."""
    b = SpecBuilder(io_data_type="bfloat16")
    x = b.tensor("X", dim=[1, 1 << 20, 1 << 17])
    b.relu(x).set_output(True).set_name("Y")
    return b.build()


def _bias_like() -> GraphSpec:
    """tests/unit/test_client_plan.py's bias-only spec."""
    b = SpecBuilder(io_data_type="bfloat16")
    a = b.tensor("A", dim=[1, 4, 8])
    bias = b.tensor("bias", dim=[1, 1, 8])
    b.bias(a, bias).set_output(True).set_name("Y")
    return b.build()


def builder_specs() -> Iterator[tuple[str, Callable[[], GraphSpec | dict[str, object]]]]:
    """(label, maker) of every spec the repository writes with SpecBuilder."""
    from bench.claim_throughput import _spec as claim_spec
    from bench.load_server import synthetic_spec
    from bench.workload import workload
    from examples.generate import EXAMPLES
    from tests.conftest import _spec as conftest_spec

    for name, spec in EXAMPLES.items():
        yield f"examples/{name}", lambda spec=spec: spec
    for spec in workload():
        yield f"bench/workload/{spec.name}", lambda spec=spec: spec
    for i in range(8):
        yield f"tests/conftest/make_spec({i})", lambda i=i: conftest_spec(i)
        yield f"bench/claim_throughput/_spec({i})", lambda i=i: claim_spec(i)
        yield f"bench/load_server/synthetic_spec({i})", lambda i=i: synthetic_spec(i)
    yield "README/graph-specs", _readme_spec
    yield "tests/integration/test_gpu_core/huge_relu", _huge_relu
    yield "tests/unit/test_client_plan/bias_like", _bias_like
    if _has_torch():
        from tests.unit.test_client_plan import conv_spec, matmul_spec

        yield "tests/unit/test_client_plan/matmul_spec", matmul_spec
        yield "tests/unit/test_client_plan/conv_spec", conv_spec


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def current_keys() -> dict[str, str]:
    return {label: graph_key(make()) for label, make in builder_specs()}


def test_every_builder_spec_keeps_its_key():
    golden = json.loads(GOLDEN.read_text())
    keys = current_keys()
    missing = sorted(set(keys) - set(golden))
    assert not missing, f"specs without a golden key: {missing}"
    changed = {label: (golden[label], key) for label, key in keys.items() if golden[label] != key}
    assert not changed, f"{len(changed)} of {len(keys)} keys changed: {changed}"
    assert len(keys) >= 80


def test_the_schema_1_files_converted_to_schema_2_keep_their_keys():
    """tests/data's two schema-1 documents were the schema-1 spelling of examples/conv_bias_relu.json and
    examples/sdpa_causal.json: the keys recorded from them are those of the schema-2 files."""
    golden = json.loads(GOLDEN.read_text())
    for legacy, example in (("legacy_conv_bias_relu", "conv_bias_relu"), ("legacy_sdpa_causal", "sdpa_causal")):
        doc = parse_spec((ROOT / "examples" / f"{example}.json").read_text())
        assert doc.schema_version == 2
        assert golden[f"tests/data/{legacy}.json"] == doc.graph_key


if __name__ == "__main__":  # python -m tests.unit.test_spec_builder > tests/data/builder_keys.json
    print(json.dumps(current_keys(), indent=1))

"""The sibling key: one for a graph and all of its shapes, another for any other graph."""

from __future__ import annotations

from examples.generate import matmul_epilogue, sdpa_causal
from plancache.canonical import canonical_json
from plancache.spec import parse_spec
from plancache.spec.axes import sibling_key, stored_sibling_key, vary


def test_a_graph_at_other_batch_sizes_and_sequence_lengths_shares_its_sibling_key():
    spec = sdpa_causal(batch=2, heads=16, seq=1024, d=128)
    shared = sibling_key(spec)
    assert shared is not None and shared != spec.graph_key
    for sizes in ({"b": 8}, {"s": 4096}, {"b": 1, "s_q": 512, "s_kv": 2048}):
        assert sibling_key(vary(spec, sizes)) == shared
    assert sibling_key(sdpa_causal(batch=4, heads=16, seq=512, d=128)) == shared  # built at that shape, not varied


def test_any_other_difference_is_another_sibling_key():
    shared = sibling_key(sdpa_causal(batch=2, heads=16, seq=1024, d=128))
    others = [sdpa_causal(batch=2, heads=8, seq=1024, d=128), sdpa_causal(batch=2, heads=16, seq=1024, d=64),
              sdpa_causal(batch=2, heads=16, seq=1024, d=128, kv_heads=4)]
    keys = {sibling_key(s) for s in others}
    assert None not in keys and shared not in keys and len(keys) == len(others)


def test_a_graph_vary_cannot_move_has_no_sibling_key():
    assert sibling_key(matmul_epilogue()) is None  # no shape axes
    doc = sdpa_causal(batch=2, heads=4, seq=64, d=32).to_json()  # with padding masks: their lengths would move too
    for uid, name in ((90, "seq_len_q"), (91, "seq_len_kv")):
        doc["tensors"].append({"uid": uid, "name": name, "data_type": "INT32", "dim": [2, 1, 1, 1],
                               "stride": [1, 1, 1, 1], "is_virtual": False})
        doc["nodes"][0]["inputs"][name] = uid
    doc["nodes"][0]["params"]["padding_mask"] = True
    assert sibling_key(parse_spec(doc)) is None


def test_a_stored_document_s_sibling_key_is_none_when_it_cannot_be_read():
    spec = sdpa_causal(batch=2, heads=16, seq=1024, d=128)
    assert stored_sibling_key(canonical_json(spec.canonical_document().to_json())) == sibling_key(spec)  # as stored
    assert stored_sibling_key("{}") is None and stored_sibling_key("not json") is None

"""The plans of a graph's other shapes, fetched in the background once a load brings one of them
(:mod:`plancache.client.siblings`), against :class:`~plancache.client.records.MemoryRecords`."""

from __future__ import annotations

import pytest

from examples.generate import sdpa_causal
from plancache.client import ClientConfig
from plancache.client.records import MemoryRecords
from plancache.errors import NotFound, ServerUnavailable
from tests.integration.test_client_ladder import MATMUL
from tests.unit.test_client_ladder import client, publish, records, signer  # noqa: F401 - fixtures

SHAPES = [sdpa_causal(batch=b, heads=16, seq=s, d=128) for b, s in ((2, 512), (2, 1024), (4, 2048), (1, 4096))]


def test_a_new_shape_whose_plan_a_sibling_brought_loads_with_no_request(records, tmp_path, signer):
    for spec in SHAPES:
        publish(records, spec, signer)
    with client(records, tmp_path, signer) as pc:
        pc.plan(SHAPES[0])
        pc.siblings.join(10)
        assert records.calls == {"resolve": 2, "siblings": 1}  # the load, then its siblings' one resolve
        assert pc.stats().siblings == 3
        for spec in SHAPES[1:]:
            assert pc.plan(spec).source == "memory"
        assert records.calls == {"resolve": 2, "siblings": 1}  # no request for the new shapes, none asked again
    with client(records, tmp_path, signer) as again:  # the next process finds them on disk, and asks nothing
        assert again.plan(SHAPES[2]).source == "disk"
        again.siblings.join(10)
    assert records.calls == {"resolve": 2, "siblings": 1}


def test_the_setting_caps_them_per_graph_and_zero_turns_them_off(records, tmp_path, signer):
    for spec in SHAPES:
        publish(records, spec, signer)
    with client(records, tmp_path / "one", signer, prefetch_siblings=1) as pc:
        pc.plan(SHAPES[0])
        pc.siblings.join(10)
        assert pc.stats().siblings == 1 and pc.plan(SHAPES[3]).source == "memory"  # the most recently published
    records.calls.clear()
    with client(records, tmp_path / "off", signer, prefetch_siblings=0) as pc:
        pc.plan(SHAPES[0])
        pc.siblings.join(10)
        assert records.calls == {"resolve": 1} and pc.stats().siblings == 0
    with pytest.raises(ValueError, match="prefetch_siblings"):
        ClientConfig(prefetch_siblings=65)


def test_graphs_without_shape_axes_ask_nothing(records, tmp_path, signer):
    publish(records, MATMUL, signer)
    with client(records, tmp_path, signer) as pc:
        pc.plan(MATMUL)
        pc.siblings.join(10)
        assert records.calls == {"resolve": 1}


def test_an_older_server_is_asked_once_and_a_failure_again_at_the_next_load(records, tmp_path, signer):
    other = [sdpa_causal(batch=2, heads=8, seq=512, d=64), sdpa_causal(batch=4, heads=8, seq=512, d=64)]
    for spec in [*SHAPES, *other]:
        publish(records, spec, signer)
    records.failures["siblings"] = [ServerUnavailable("down for now")]
    with client(records, tmp_path / "a", signer) as pc:
        pc.plan(SHAPES[0])
        pc.siblings.join(10)
        assert pc.stats().siblings == 0
        pc.plan(SHAPES[1])  # another shape of the same graph: asked again
        pc.siblings.join(10)
        assert records.calls["siblings"] == 2 and pc.stats().siblings == 2
    records.calls.clear()
    records.failures["siblings"] = [NotFound("no such route")]  # a server of API 1.3
    with client(records, tmp_path / "b", signer) as pc:
        pc.plan(SHAPES[0])
        pc.siblings.join(10)
        pc.plan(other[0])  # another graph: not asked
        pc.siblings.join(10)
        assert records.calls["siblings"] == 1 and pc.stats().siblings == 0


def test_an_answer_naming_more_siblings_than_asked_for_is_cut_to_the_limit(records, tmp_path, signer, monkeypatch):
    for spec in SHAPES:
        publish(records, spec, signer)
    listed = MemoryRecords.siblings

    def generous(self, environment, graph_keys, *, limit, deadline=None):  # a server that ignores the limit
        return listed(self, environment, graph_keys, limit=64, deadline=deadline)

    monkeypatch.setattr(MemoryRecords, "siblings", generous)
    with client(records, tmp_path, signer, prefetch_siblings=2) as pc:
        pc.plan(SHAPES[0])
        pc.siblings.join(10)
        assert pc.stats().siblings == 2

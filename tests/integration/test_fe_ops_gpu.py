"""FE's own build paths served on the GPU (tests/fe_ops_gpu_child.py names them): a normal-mode process with
``plancache.torch.install`` runs every path, each graph misses, FE builds it as it asked and its spec is
registered; every registered miss is then autotuned here from its document alone and published signed; a fresh
strict-mode process (``CUDA_CACHE_DISABLE=1``) then gets every graph from the server, FE plans none of them,
and forward and backward match a float32 reference -- also offline from the disk cache in replay-only mode, and
warm-started from the capture file the first process wrote (one resolve for every graph, none when they are built)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plancache.spec import parse_spec
from tests.gpu_util import requires_gpu, tune_misses
from tests.live_server import LiveServer

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = Path(__file__).resolve().parents[2]
RESOLVE = "/v1/plans/resolve"
TOLERANCE = 2e-2  # bfloat16 outputs and gradients, normalised max error (plancache.gpu.reference.TOLERANCE)
#: Paths whose graphs the tuner cannot tune yet, and why (their strict run is a PlanMiss, as strict mode promises).
UNTUNED = {"sdpa_thd": "tuning FE's ragged (THD) attention backward graph hits an illegal instruction in the tuning "
                       "process (docs/FE.md)"}
#: The FE graphs each path builds in a fresh process, each its own hit (or FE build): an attention path its forward and
#: backward (the padded one its forward: FE's autograd has no padded backward), a norm its forward and backward.
#: ``cuda_graph_replay`` runs ``sdpa_causal``'s shapes, whose graphs FE's own graph cache already holds.
GRAPHS = {"sdpa_causal": 2, "sdpa_gqa": 2, "sdpa_padded": 1, "sdpa_thd": 2, "sdpa_bottom_right": 2, "sdpa_window": 2,
          "layer_norm": 2, "rms_norm": 2, "cudnn_graph": 1, "graph_cache": 1, "cuda_graph_replay": 0}
#: Paths of plancache's route for F.scaled_dot_product_attention (plancache.client.sdpa): their graphs, forward and
#: backward. In a normal process the route builds a missed graph through the cache's ladder (a ``heuristic`` hit),
#: not through FE's op.
ROUTED = {"torch_sdpa": 2}
#: Paths of FE's norm ops, whose graph caches take a served plan loaded on its own (plancache.client.fe_ops): each of
#: their served graphs is held as one, none of those FE built.
WHOLE = ("layer_norm", "rms_norm")


def child(*args: str, settings: dict[str, str] | None = None) -> dict:
    """Run tests/fe_ops_gpu_child.py with ``args``; ``settings``: its only ``PLANCACHE_*`` variables (the attention
    route's steady path in Python unless they say otherwise: what a child measures does not depend on whether this
    machine has the C++ extension built; and no plans of other shapes fetched ahead, so that each path's plans come
    from its own loads, never from another path's that happens to be the same graph at another shape: the route's
    GPU test covers that)."""
    env = ({k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
           | {"PLANCACHE_ATTENTION_CPP": "0", "PLANCACHE_PREFETCH_SIBLINGS": "0"} | (settings or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env["CUDA_CACHE_DISABLE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "tests.fe_ops_gpu_child", *args], capture_output=True, text=True,
                          timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    run["log"] = [line for line in proc.stderr.splitlines() if line.startswith("plancache")][-20:]  # its warnings
    return run


def describe(doc: dict) -> str:
    spec = parse_spec(doc)
    ragged = any(t.ragged_offset is not None for t in spec.tensors)
    return f"{'+'.join(n.type for n in spec.nodes)}{' ragged' if ragged else ''} {[t.dim for t in spec.tensors][:3]}"


def check_served(run: dict, what: str, *, hits: str | None, untuned: bool = False) -> None:
    """Each path built exactly its :data:`GRAPHS`, every one a hit of ``hits`` (``memory``, ``server``, ``disk``) and
    none built by FE, those of :data:`WHOLE` held served whole; with ``hits`` None (a normal process, nothing tuned
    yet) every one a miss FE built. Totals could hide a path that stopped being served behind another that built more;
    so each path is checked on its own."""
    assert set(run["paths"]) == set(GRAPHS) | set(ROUTED), sorted(run["paths"])
    bad = []
    for name, n in {**GRAPHS, **ROUTED}.items():
        got = run["paths"][name]
        if untuned and name in UNTUNED:
            continue  # a PlanMiss part-way (check_numerics)
        if hits is None:
            want = ({"heuristic": n}, {}) if name in ROUTED else ({}, {"miss": n} if n else {})
        else:
            want = ({hits: n} if n else {}, {})
        if (got.get("hits", {}), got.get("fe_builds", {})) != want:
            bad.append(f"{name}: hits {got.get('hits')} fe_builds {got.get('fe_builds')}, expected {want[0]} and {want[1]}")
        if name in WHOLE and got.get("whole") != (0 if hits is None else n):
            bad.append(f"{name}: {got.get('whole')} graphs held served whole, expected {0 if hits is None else n}")
    assert not bad, f"{what}:\n" + "\n".join(bad) + f"\nstats: {run['stats']}\nits warnings:\n" + "\n".join(run["log"])


def check_numerics(run: dict, what: str, *, untuned: bool = False) -> None:
    """Every path ran and every output and gradient is within tolerance (all failures in one message); with
    ``untuned``, the paths of :data:`UNTUNED` must instead have raised PlanMiss."""
    bad = []
    for name, got in run["paths"].items():
        if untuned and name in UNTUNED:
            if not got.get("error", "").startswith("PlanMiss"):
                bad.append(f"{name}: expected a PlanMiss ({UNTUNED[name]}), got {got}")
            continue
        if "error" in got:
            bad.append(f"{name}: {got['error']}")
            continue
        bad += [f"{name} {out}: error {err}" for out, err in got["errors"].items()
                if not out.startswith("route_") and not err <= TOLERANCE]
    assert not bad, f"{what}:\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from plancache.signing import Signer, keygen

    root = tmp_path_factory.mktemp("fe_ops")
    priv, _, _ = keygen(root / "keys")
    signer = Signer.from_file(priv)
    with LiveServer(root / "server") as srv:
        capture = child("--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys"),
                        "--cache", str(root / "capture-cache"), "--mode", "normal",
                        settings={"PLANCACHE_CAPTURE": str(root / "capture.json")})
        tuned, why = tune_misses(srv, root, signer)
        failed = {}
        for key, error in why.items():
            doc = srv.store.get_spec(key)
            assert doc is not None, f"the miss {key[:12]} was recorded without its spec"
            failed[key] = f"{describe(doc)}: {error}"
        yield srv, root, capture, tuned, failed


def test_a_normal_process_builds_every_miss_with_fe_and_registers_it(fleet):
    _, _, capture, tuned, failed = fleet
    check_numerics(capture, "capture")
    ragged = {k: v for k, v in failed.items() if " ragged " in v}
    assert ragged == failed and len(failed) <= 1, "\n".join(f"{k[:12]} {v}" for k, v in failed.items())
    for key, why in failed.items():
        print(f"\nnot tuned ({UNTUNED['sdpa_thd']}): {key[:12]} {why[:300]}")
    check_served(capture, "capture", hits=None)
    stats = capture["stats"]
    routed = sum(ROUTED.values())
    assert stats["hits"] == {"heuristic": routed} and stats["fe_builds"] == {"miss": stats["misses"] - routed}
    assert stats["misses"] >= sum(GRAPHS.values()) + routed
    assert tuned + len(failed) == stats["misses"]
    print(f"\ncapture: {stats['misses']} FE graphs missed, were built by FE and registered; all {tuned} tuned")


def test_a_fresh_strict_process_gets_every_fe_graph_from_the_server(fleet, tmp_path):
    srv, root, capture, tuned, failed = fleet
    online = child("--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys"),
                   "--cache", str(tmp_path / "cache"), "--mode", "strict")
    check_numerics(online, "strict", untuned=bool(failed))
    check_served(online, "strict", hits="server", untuned=bool(failed))
    assert online["stats"]["fe_builds"] == {} and online["stats"]["rejects"] == {}
    assert online["stats"]["hits"] == {"server": tuned}
    assert online["paths"]["torch_sdpa"]["deserialize_ms"] > 0  # the route loads its two plans at its first call
    offline = child("--trusted", str(root / "keys"), "--cache", str(tmp_path / "cache"), "--mode", "replay_only")
    check_numerics(offline, "replay_only", untuned=bool(failed))
    check_served(offline, "replay_only", hits="disk", untuned=bool(failed))
    assert offline["stats"]["hits"] == {"disk": tuned} and offline["stats"]["fe_builds"] == {}
    nan = float("nan")
    print(f"\n{'path':<20}{'graphs':>7}{'first ms (FE)':>15}{'first ms (served)':>19}{'offline':>9}"
          f"{'op alone: FE':>14}{'served':>8}{'offline':>9}  max error")
    for name, got in online["paths"].items():
        cap, off = capture["paths"][name], offline["paths"][name]
        if "first_ms" not in got:
            print(f"{name:<20} {got.get('error', '')[:80]}")
            continue
        n = sum(got["hits"].values())
        worst = max((e for o, e in got["errors"].items() if not o.startswith("route_")), default=0.0)
        print(f"{name:<20}{n:>7}{cap.get('first_ms', nan):>15.1f}{got['first_ms']:>19.1f}{off.get('first_ms', nan):>9.1f}"
              f"{cap.get('op_ms', nan):>14.1f}{got.get('op_ms', nan):>8.1f}{off.get('op_ms', nan):>9.1f}  {worst:.2e}")


@pytest.mark.parametrize("cpp", [False, True], ids=["python", "cpp"])
def test_a_warm_start_from_the_capture_file_asks_the_server_once(fleet, tmp_path, cpp):
    """PLANCACHE_WARM: a fresh strict process fetches every captured graph's plan in one resolve at install; each
    path's graphs then load from the kept blobs (memory), none asks the server; a graph without a tuned plan
    (:data:`UNTUNED`), which that resolve missed, raises PlanMiss when built without asking again (a client
    remembers a miss for a minute: plancache.client.remote.MISS_RECHECK_SECONDS). The plans of the attention
    route's graphs and of FE's norm ops' graphs, which run from graphs of their own, are deserialized at the warm
    start: their first calls load nothing. ``cpp``: with the attention route's C++ steady path, which the warm start
    loads the route's plans into."""
    srv, root, capture, tuned, failed = fleet
    before = srv.requests[RESOLVE]
    warm = child("--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys"),
                 "--cache", str(tmp_path / "cache"), "--mode", "strict",
                 settings={"PLANCACHE_WARM": str(root / "capture.json"),
                           **({"PLANCACHE_ATTENTION_CPP": "1"} if cpp else {})})
    check_numerics(warm, "warm", untuned=bool(failed))
    check_served(warm, "warm", hits="memory", untuned=bool(failed))
    assert srv.requests[RESOLVE] - before == 1
    stats = warm["stats"]
    assert stats["hits"] == {"server": tuned, "memory": tuned} and stats["fe_builds"] == {}
    assert [name for name, got in warm["paths"].items() if "server" in got.get("hits", {})] == []
    # the route's plans run from graphs of plancache's own: the warm start deserialized them, the first call nothing
    assert warm["paths"]["torch_sdpa"]["deserialize_ms"] == 0, warm["paths"]["torch_sdpa"]
    # FE's norm ops' graph caches take their plans loaded on their own: the warm start loaded those too
    for name in WHOLE:
        assert warm["paths"][name]["deserialize_ms"] == 0, (name, warm["paths"][name])
    # and made the handles those ops keep per thread: the first op's thread and autograd's took one each
    assert warm["handles_in_stock"] == 0, warm["handles_in_stock"]
    route = warm["sdpa_route"]
    if cpp:  # the first call bound the plans the warm start loaded into the C++ side, and ran there
        assert not route.get("cpp_unavailable") and route.get("cpp:fwd", 0) >= 1 and route.get("cpp:bwd", 0) >= 1, route
    else:
        assert "cpp:fwd" not in route, route
    nan = float("nan")
    print(f"\n{'path':<20}{'first ms (FE)':>15}{'first ms (served, warm)':>25}{'op alone: FE':>14}{'warm':>8}")
    for name, got in warm["paths"].items():
        if "first_ms" in got:
            cap = capture["paths"][name]
            print(f"{name:<20}{cap.get('first_ms', nan):>15.1f}{got['first_ms']:>25.1f}{cap.get('op_ms', nan):>14.1f}"
                  f"{got.get('op_ms', nan):>8.1f}")


def test_torch_sdpa_goes_through_plancaches_route(fleet):
    _, _, capture, _, _ = fleet
    got = capture["paths"]["torch_sdpa"]
    assert "error" not in got, got
    assert got["errors"]["route_fwd_calls"] >= 1 and got["errors"]["route_bwd_calls"] >= 1

"""``plancache.torch.install`` on the CPU: the hook goes in, FE's SDPA provider is turned on by the route the
installed torch takes, and ``uninstall`` undoes both."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

import plancache.torch  # noqa: E402
from plancache.client import PlanCache  # noqa: E402
from tests.client_fakes import RecordingBackend  # noqa: E402


@pytest.fixture
def cache(tmp_path):
    return PlanCache("", backend=RecordingBackend(), cache_dir=tmp_path, trusted_keys=[])


def test_the_switch_is_used_where_torch_has_it(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp_python", calls.append, raising=False)
    assert plancache.torch.sdpa_route() == "torch_switch"
    original = cudnn.pygraph.build_plans
    assert plancache.torch.install(cache) is cache
    try:
        assert plancache.torch.installed_route() == "torch_switch" and calls == [True]
        assert cudnn.pygraph.build_plans is not original  # the hook is in
    finally:
        plancache.torch.uninstall()
    assert calls == [True, False] and plancache.torch.installed_route() is None
    assert cudnn.pygraph.build_plans is original


@pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
                    reason=f"torch {torch.__version__} has no flash-attention implementation registry")
def test_the_flash_registry_activates_fes_provider(cache):
    import torch.nn.attention as attention

    assert plancache.torch.sdpa_route() == "flash_registry"
    plancache.torch.install(cache)
    try:
        assert attention.current_flash_attention_impl() == "CUDNN"
    finally:
        plancache.torch.uninstall()
    assert attention.current_flash_attention_impl() is None


def test_the_provider_can_be_left_off(cache):
    plancache.torch.install(cache, sdpa_provider=False)
    try:
        assert plancache.torch.installed_route() is None
    finally:
        plancache.torch.uninstall()


@pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
                    reason=f"torch {torch.__version__} has no flash-attention implementation registry")
def test_uninstall_leaves_fes_provider_on_where_the_program_turned_it_on(cache):
    import torch.nn.attention as attention

    attention.activate_flash_attention_impl("CUDNN")
    try:
        plancache.torch.install(cache)
        plancache.torch.uninstall()
        assert attention.current_flash_attention_impl() == "CUDNN"
    finally:
        attention.restore_flash_attention_impl(_raise_warn=False)


class _FakeSwitch:
    """torch's ``enable_cudnn_sdp_python`` and its reading ``cudnn_sdp_python_enabled``, on one flag."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.calls: list[bool] = []

    def enable(self, on: bool) -> None:
        self.calls.append(on)
        self.on = on

    def enabled(self) -> bool:
        return self.on


@pytest.mark.parametrize("program_on", [True, False])
def test_uninstall_leaves_the_switch_as_the_program_set_it(cache, monkeypatch, program_on):
    switch = _FakeSwitch(program_on)
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp_python", switch.enable, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_python_enabled", switch.enabled, raising=False)
    plancache.torch.install(cache)
    try:
        assert switch.on and plancache.torch.installed_route() == "torch_switch"
    finally:
        plancache.torch.uninstall()
    assert switch.on is program_on
    assert switch.calls == ([] if program_on else [True, False])


@pytest.mark.skipif(not hasattr(torch.nn.attention, "activate_flash_attention_impl"),
                    reason=f"torch {torch.__version__} has no flash-attention implementation registry")
def test_uninstall_activates_again_the_flash_implementation_install_replaced(cache, monkeypatch):
    import torch.nn.attention as attention
    from torch.nn.attention import _registry

    live: list[str] = []

    class _Handle:
        def remove(self) -> None:
            live.remove("FAKE")

    def register() -> _Handle:
        live.append("FAKE")
        return _Handle()

    monkeypatch.setitem(_registry._FLASH_ATTENTION_IMPLS, "FAKE", register)
    attention.activate_flash_attention_impl("FAKE")
    try:
        plancache.torch.install(cache)
        try:
            assert attention.current_flash_attention_impl() == "CUDNN" and live == []
        finally:
            plancache.torch.uninstall()
        assert attention.current_flash_attention_impl() == "FAKE" and live == ["FAKE"]
    finally:
        attention.restore_flash_attention_impl(_raise_warn=False)

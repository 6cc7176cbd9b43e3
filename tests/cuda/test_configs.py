"""The static kernel table and the backend order (CPU only: no GPU is touched)."""

from __future__ import annotations

import pytest
import torch

from ternop import backends
from ternop.cuda import configs, registry

DEV = torch.device("cuda", 0)  # a device object only; CUDA is never initialised


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (9, 0))


def test_configs_buckets_cover_every_m(sm90):
    for m in (1, 2, 3, 16, 17, 64, 65, 257, 4097, 1 << 20):
        config, why = configs.lookup("triton_gemm", m, DEV)
        assert isinstance(config, configs.GemmConfig), why
        assert config.block_m >= min(m, 16)
        config, why = configs.lookup("dequant_cublas", m, DEV)
        assert isinstance(config, configs.DequantConfig), why


def test_configs_small_m_backends_decline_large_m_unless_forced(sm90):
    config, why = configs.lookup("cuda_gemv", 3, DEV)
    assert config is None and "M=3" in why and "sm90" in why
    config, _ = configs.lookup("cuda_gemv", 3, DEV, forced=True)
    assert isinstance(config, configs.CudaGemvConfig)
    assert configs.lookup("triton_gemv", 4, DEV)[0] is not None
    assert configs.lookup("triton_gemv", 5, DEV)[0] is None


def test_configs_tables_are_ascending_and_well_formed():
    for arch, table in configs.TABLES.items():
        for name, buckets in table.items():
            bounds = [max_m for max_m, _ in buckets]
            assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), (arch, name)
            for _, config in buckets:
                if isinstance(config, (configs.GemvConfig, configs.DequantConfig)):
                    assert config.block_k % 128 == 0, (arch, name, config)


def test_registry_order_and_names():
    registry.register_all()
    names = [b.name for b in backends.available("cuda")]
    assert names == ["cuda_mma", "cuda_gemv", "dequant_cublas", "triton_gemm", "triton_gemv"]


def test_configs_cuda_mma_takes_m_up_to_16(sm90):
    for m in (1, 8, 9, 16):
        config, why = configs.lookup("cuda_mma", m, DEV)
        assert isinstance(config, configs.CudaMmaConfig), why
    config, why = configs.lookup("cuda_mma", 17, DEV)
    assert config is None and "M=17" in why


def test_configs_wide_layers_skip_dequantizing_at_moderate_m(sm90, monkeypatch):
    from types import SimpleNamespace

    assert configs.fused_beats_dequant(64, 14336, DEV) and configs.fused_beats_dequant(128, 28672, DEV)
    assert not configs.fused_beats_dequant(64, 4096, DEV)  # narrower: dequantizing wins
    assert not configs.fused_beats_dequant(129, 28672, DEV)  # larger M: dequantizing wins
    # The registry's answer, with the Triton availability check stubbed (no GPU here).
    monkeypatch.setattr(registry, "_can_triton", lambda name: lambda *args: (True, ""))
    monkeypatch.delenv("TERNOP_BACKEND", raising=False)
    x = SimpleNamespace(shape=(64, 4096), device=DEV)
    wide, narrow = SimpleNamespace(shape=(24576, 1024)), SimpleNamespace(shape=(4096, 1024))
    ok, why = registry._can_dequant_cublas(x, wide, None, None)
    assert not ok and "M=64, N=24576" in why and "fused GEMM" in why
    assert registry._can_dequant_cublas(x, narrow, None, None) == (True, "")
    assert registry._can_dequant_cublas(SimpleNamespace(shape=(63, 4096), device=DEV), narrow, None, None)[0] is False
    monkeypatch.setenv("TERNOP_BACKEND", "dequant_cublas")  # forcing overrides the table
    assert registry._can_dequant_cublas(x, wide, None, None) == (True, "")


def test_configs_other_archs_keep_dequantizing(monkeypatch):
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (8, 0))
    assert not configs.fused_beats_dequant(64, 28672, DEV)

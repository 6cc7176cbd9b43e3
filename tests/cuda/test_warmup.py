"""ternop.warmup: the batch sizes it asks, the variants it finds, and (on a GPU) that nothing is left
to compile after it. The plan tests run on the CPU against the sm90 tables, no GPU touched."""

from __future__ import annotations

import importlib
import random
from types import SimpleNamespace

import pytest
import torch

from ternop import backends, layouts, warmup
from ternop.cuda import configs, registry
from tests.conftest import requires_cuda
from tests.reference import assert_within_2x_of_dense, random_packed

DEV = torch.device("cuda", 0)  # a device object only in the plan tests; CUDA is never initialised

# (N, K) of the benchmark's layers: the Qwen3-8B family, then the Qwen3-0.6B one.
LAYERS = [(4096, 4096), (14336, 4096), (28672, 4096), (4096, 14336),
          (4096, 1024), (6144, 1024), (1024, 2048), (1024, 3072)]  # fmt: skip
# (activation bits, layout, scale form): 16-bit, int8 with row scales, int8 with block scales.
MODES = [(16, "a16", "blocks"), (8, "a8", "row"), (8, "a8", "blocks")]


def test_sample_ms_holds_every_small_m_each_multiple_of_16_the_m_after_it_and_the_edges():
    ms = warmup.sample_ms(2000, edges=(777, 1999, 5000))
    assert ms == sorted(set(ms))
    assert set(range(1, 513)) <= set(ms)
    assert {m for m in range(16, 2001, 16)} | {m + 1 for m in range(16, 2000, 16)} <= set(ms)
    assert {777, 1999, 2000} <= set(ms) and max(ms) == 2000  # an edge past max_m is dropped
    assert 600 not in ms and 1000 not in ms  # only the sampled Ms above 512
    assert warmup.sample_ms(5) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="max_m=0"):
        warmup.sample_ms(0)


def _hopper(monkeypatch, graph_max_m):
    """The registry of an sm_90a build on an H200, as far as it asks; the Triton launchers' own
    rules (tiles, splits, the quantization's block) are the real ones."""
    pytest.importorskip("triton")
    fused = importlib.import_module("ternop.cuda.launch_fused")
    from ternop.cuda import cuda_ext

    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (9, 0))
    monkeypatch.setitem(configs._SM_COUNT_CACHE, 0, 132)
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.delenv(backends.ENV_SKIP, raising=False)
    monkeypatch.delenv(configs.ENV_GRAPH_MAX_M, raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", graph_max_m)
    monkeypatch.setattr(registry, "_cuda_ext_ready", lambda call, layouts: (True, ""))
    monkeypatch.setattr(registry, "_hopper_wgmma", lambda call: "")
    monkeypatch.setattr(registry, "_module", lambda name: (fused if name == "launch_fused" else object(), ""))
    monkeypatch.setattr(cuda_ext, "load", lambda: (True, ""))
    registry.register_all()
    backends.clear_cache()


@pytest.fixture
def clean_choices():
    """Leaves no choice made on the stand-in GPU in the registry's cache for later tests."""
    yield
    backends.clear_cache()


def _maker(n, k, bits, layout, scales):
    """M -> a call of M rows on an N x K layer, as shapes only."""
    w = SimpleNamespace(shape=(n, k // 4), data_ptr=lambda: 0, is_contiguous=lambda: True)
    s = SimpleNamespace(shape=(n, 1 if scales == "row" else k // 128), is_contiguous=lambda: True)

    def make(m):
        x = SimpleNamespace(shape=(m, k), device=DEV, dtype=torch.bfloat16, data_ptr=lambda: 0,
                            stride=lambda d: k if d == 0 else 1, is_cuda=True)  # fmt: skip
        return backends.LinearCall(x, w, s, None, bits, layout)

    return make


@pytest.mark.parametrize("graph_max_m", [128, 512])
def test_sampled_plan_finds_every_variant_that_any_m_reaches(monkeypatch, clean_choices, graph_max_m):
    """The sampled batch sizes reach the same (backend, variant) pairs as every M from 1 to 4608
    does, on each benchmark layer in each mode, with vLLM's decode (128) and default (512) graph
    bounds. Every rule that depends on M changes its answer below 4608 on these layers (the eager
    bounds: M * N * K = 2^33 is at most 4096 here)."""
    _hopper(monkeypatch, graph_max_m)
    top = 4608
    found = 0
    for n, k in LAYERS:
        for bits, layout, scales in MODES:
            make = _maker(n, k, bits, layout, scales)
            every = {(b, v) for _, b, v in warmup.plan(make, range(1, top + 1))}
            sampled = warmup.plan(make, warmup.sample_ms(top, configs.host_rule_edges(n, k)))
            assert {(b, v) for _, b, v in sampled} == every, (n, k, bits, scales)
            found += sum(b.startswith("triton") for _, b, _ in sampled)
    assert found > 0  # Triton variants are among them, which is what the warm-up is for


def test_plan_runs_each_variant_at_its_smallest_m(monkeypatch, clean_choices):
    """Row-scaled int8 on 4096 -> 4096 with graphs to 128 tokens: triton_a8 serves M = 33..64 under
    the graphs (cuda_mma_a8's four token tiles take M = 17..32 on Hopper) in one tile, in two classes
    of M (the multiples of 16 are compiled apart)."""
    _hopper(monkeypatch, 128)
    monkeypatch.setattr(configs, "_triton_has_gdc", lambda: True)
    monkeypatch.delenv("TERNOP_PDL", raising=False)
    steps = warmup.plan(_maker(4096, 4096, 8, "a8", "row"), warmup.sample_ms(4096, configs.host_rule_edges(4096, 4096)))
    triton = [(m, v[0].block_m, v[2]) for m, b, v in steps if b == "triton_a8" and m <= 64]
    assert triton == [(33, 64, "any"), (48, 64, "16n")]
    assert {b for m, b, _ in steps if m <= 32} == {"cuda_mma_a8"}
    assert [m for m, _, _ in steps] == sorted(m for m, _, _ in steps)
    assert steps[0][:2] == (1, "cuda_mma_a8")  # N * K = 2^24: the early-started pair (configs.a8_fused_declines)


def test_plan_runs_the_triton_int8_kernel_started_early_and_plain_apart(monkeypatch, clean_choices):
    """On 1024 -> 6144 with row scales the Triton int8 kernel starts early up to M = 512 and plainly
    above (configs.triton_a8_starts_early): one tile, one split and one class of M are then two
    kernels to Triton, and the plan runs both (M = 257 and 1366). TERNOP_PDL=0 leaves no early one."""
    _hopper(monkeypatch, 512)
    monkeypatch.setattr(configs, "_triton_has_gdc", lambda: True)
    monkeypatch.delenv("TERNOP_PDL", raising=False)
    make = _maker(6144, 1024, 8, "a8", "row")
    ms = warmup.sample_ms(4096, configs.host_rule_edges(6144, 1024))
    triton = {m: v for m, b, v in warmup.plan(make, ms) if b == "triton_a8"}
    assert all((registry.EARLY in v) == (m <= 512) for m, v in triton.items()), triton
    assert triton[257][:3] == triton[1366][:3] and triton[257] != triton[1366]
    monkeypatch.setenv("TERNOP_PDL", "0")
    backends.clear_cache()
    assert not any(registry.EARLY in v for _, b, v in warmup.plan(make, ms) if b == "triton_a8")


def test_warm_up_leaves_cpu_layers_alone():
    packed, scale = random_packed(64, 256, generator=torch.Generator().manual_seed(0))
    assert warmup.warm_up(packed, scale, activation_bits=16, layout="v1", dtype=torch.float32, max_m=64) == []


def test_warmup_switch(monkeypatch):
    monkeypatch.delenv(warmup.ENV_WARMUP, raising=False)
    assert warmup.enabled()
    monkeypatch.setenv(warmup.ENV_WARMUP, "0")
    assert not warmup.enabled()
    monkeypatch.setenv(warmup.ENV_WARMUP, "1")
    assert warmup.enabled()


def _compiled() -> int:
    """How many Triton kernels ternop's modules hold compiled, over every device."""
    total = 0
    for name in ("triton_fused", "triton_dequant_a8", "triton_kernels", "triton_norm_quant"):
        mod = importlib.import_module(f"ternop.cuda.{name}")
        for fn in vars(mod).values():
            caches = getattr(fn, "device_caches", None)
            if caches is not None:
                total += sum(len(entry[0]) for entry in list(caches.values()))
    return total


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits, scales", [(8, "row"), (8, "blocks"), (16, "blocks")])
def test_warm_up_leaves_nothing_to_compile(monkeypatch, bits, scales):
    """After the warm-up of a layer, calls of any M up to its max_m compile no Triton kernel, and
    they still match the CPU reference."""
    monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    monkeypatch.delenv(backends.ENV_SKIP, raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", 128)
    monkeypatch.setattr(warmup, "_WARMED", set())
    gen = torch.Generator().manual_seed(bits)
    n, k, top = 4096, 4096, 1100
    packed, scale = random_packed(n, k, generator=gen)
    if scales == "row":
        scale = scale[:, :1].contiguous()
    layout = "a8" if bits == 8 else "a16"
    w = layouts.repack(packed, layout).cuda()
    s = scale.cuda()
    steps = warmup.warm_up(w, s, activation_bits=bits, layout=layout, dtype=torch.bfloat16, max_m=top)
    assert steps and steps[0][0] == 1
    assert warmup.warm_up(w, s, activation_bits=bits, layout=layout, dtype=torch.bfloat16, max_m=top) == []
    before = _compiled()
    ms = sorted({17, 31, 32, 47, 48, 63, 65, 129, 171, 176, 300, 511, 513, 1024, 1025, top}
                | set(random.Random(bits).sample(range(1, top + 1), 24)))  # fmt: skip
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        y = torch.ops.ternop.linear(x.cuda(), w, s, None, bits, layout)
        if m in (31, 300) and bits == 16:  # the fp64 oracle: slow at larger M
            assert_within_2x_of_dense(y.cpu(), x, packed, scale)
        elif bits == 8 and m in (31, 300, 1025):  # int8: the same int32 sums as the CPU reference, then its scalings
            ref = torch.ops.ternop.linear(x, packed, scale, None, bits, "v1")
            torch.testing.assert_close(y.cpu().float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    assert _compiled() == before, f"compiled during serving after the warm-up ({steps})"

"""The static kernel table and the backend order (CPU only: no GPU is touched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ternop import backends
from ternop.cuda import configs, registry

DEV = torch.device("cuda", 0)  # a device object only; CUDA is never initialised


def _sm90(monkeypatch):
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (9, 0))
    monkeypatch.setitem(configs._SM_COUNT_CACHE, 0, 132)  # an H100 / H200


def test_configs_buckets_cover_every_m(monkeypatch):
    _sm90(monkeypatch)
    for m in (1, 2, 3, 16, 17, 64, 65, 257, 4097, 1 << 20):
        for name in ("triton_a16", "triton_a8"):
            config, why = configs.lookup(name, m, DEV)
            assert isinstance(config, configs.FusedConfig), why
        config, why = configs.lookup("triton_gemm", m, DEV)
        assert isinstance(config, configs.GemmConfig), why
        config, why = configs.lookup("dequant_cublas", m, DEV)
        assert isinstance(config, configs.DequantConfig), why


def test_configs_small_m_backends_decline_large_m_unless_forced(monkeypatch):
    _sm90(monkeypatch)
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
                if isinstance(config, configs.FusedConfig):
                    assert config.block_m in (16, 32, 64, 128, 256) and config.block_n in (32, 64, 128, 256)
                    assert config.max_split_k >= 1


def test_registry_order_and_names():
    registry.register_all()
    names = [b.name for b in backends.available("cuda")]
    assert names == ["cuda_mma_a8_fused", "cuda_mma", "cuda_mma_a8", "cuda_wgmma", "cuda_dequant_a8", "cuda_mma_tiles", "dequant_a8",
                     "cuda_wgmma_a8", "cuda_gemv",
                     "triton_a8",
                     "cuda_dequant",
                     "dequant_cublas", "triton_a16", "triton_gemm", "triton_gemv", "dequant_any"]


def test_configs_cuda_mma_takes_m_up_to_16_and_on_hopper_64_in_slabs(monkeypatch):
    _sm90(monkeypatch)
    for m in (1, 8, 9, 16, 17, 64):
        config, why = configs.lookup("cuda_mma", m, DEV)
        assert isinstance(config, configs.CudaMmaConfig), why
    config, why = configs.lookup("cuda_mma", 65, DEV)
    assert config is None and "M=65" in why
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (8, 0))
    config, why = configs.lookup("cuda_mma", 17, DEV)
    assert config is None and "M=17" in why


def test_configs_split_k_fills_the_gpu_only_when_tiles_are_few():
    assert configs.split_k(tiles=1000, k_blocks=32, sms=132, max_split=8) == 1
    assert configs.split_k(tiles=16, k_blocks=32, sms=132, max_split=8) == 8
    assert configs.split_k(tiles=16, k_blocks=8, sms=132, max_split=8) == 2  # at least 4 blocks a slice
    assert configs.split_k(tiles=224, k_blocks=32, sms=132, max_split=8) == 3
    assert configs.split_k(tiles=16, k_blocks=32, sms=132, max_split=1) == 1


def test_registry_dequant_floor(monkeypatch):
    from types import SimpleNamespace

    _sm90(monkeypatch)
    monkeypatch.setattr(registry, "_module", lambda name: (SimpleNamespace(), ""))
    monkeypatch.delenv("TERNOP_BACKEND", raising=False)
    floor = configs.min_m("dequant_cublas", DEV)

    def call(m):
        x = SimpleNamespace(shape=(m, 4096), device=DEV, dtype=torch.bfloat16)
        w = SimpleNamespace(shape=(4096, 1024), data_ptr=lambda: 0)
        return backends.LinearCall(x, w, None, None)

    assert registry._can_dequant_cublas(call(floor)) == (True, "")
    ok, why = registry._can_dequant_cublas(call(floor - 1))
    assert not ok and f"M={floor - 1}" in why
    monkeypatch.setenv("TERNOP_BACKEND", "dequant_cublas")  # forcing overrides the floor
    assert registry._can_dequant_cublas(call(1)) == (True, "")


def test_registry_cuda_mma_tiles_takes_m_17_to_64(monkeypatch):
    """Its floor (cuda_mma below), its bucket (the Triton GEMM above) and its layout; past those
    checks only the extension is missing here."""
    from types import SimpleNamespace

    _sm90(monkeypatch)
    monkeypatch.delenv("TERNOP_BACKEND", raising=False)

    def call(m, layout="a16", dtype=torch.bfloat16, bits=16):
        x = SimpleNamespace(shape=(m, 1024), device=DEV, dtype=dtype, data_ptr=lambda: 0, stride=lambda d: 1024)
        w = SimpleNamespace(shape=(4096, 256), data_ptr=lambda: 0)
        return backends.LinearCall(x, w, None, None, bits, layout)

    can = registry._can_cuda_mma_tiles
    assert "M=16 is below M=17" in can(call(16))[1]
    assert "M=65 is above cuda_mma_tiles's largest bucket" in can(call(65))[1]
    assert "float32" in can(call(40, dtype=torch.float32))[1]
    assert "16-bit activations only" in can(call(40, bits=8, layout="a8"))[1]
    assert "layout 'v1'" in can(call(40, layout="v1"))[1]
    for m in (17, 40, 64):
        ok, why = can(call(m))
        assert ok or "extension not built" in why, why  # every dispatch check passed (built on a GPU machine)


def test_registry_cuda_wgmma_takes_large_layers_from_m_9(monkeypatch):
    """Its floor (cuda_mma below), the shape rules of configs.wgmma_declines, and the GPU it
    needs (sm_90a cubins load on compute capability 9.0 only); past those only the extension is
    missing on a CPU machine."""
    from types import SimpleNamespace

    _sm90(monkeypatch)
    monkeypatch.delenv("TERNOP_BACKEND", raising=False)

    def call(m, k=4096, n=14336, layout="a16", dtype=torch.bfloat16):
        x = SimpleNamespace(shape=(m, k), device=DEV, dtype=dtype, data_ptr=lambda: 0, stride=lambda d: k)
        w = SimpleNamespace(shape=(n, k // 4), data_ptr=lambda: 0)
        return backends.LinearCall(x, w, None, None, 16, layout)

    can = registry._can_cuda_wgmma
    assert "M=8 is below M=9" in can(call(8))[1]
    assert "only wide layers" in can(call(16, n=4096))[1]  # 4096 -> 4096 keeps cuda_mma up to M = 16
    assert "only wide layers" in can(call(16, k=2048, n=6144))[1]  # N * K below 2^25
    assert "N * K = 3145728" in can(call(64, k=3072, n=1024))[1]  # the N = 1024 layers keep cuda_mma_tiles
    assert "N * K = 1048576" in can(call(64, k=1024, n=1024))[1]  # K = 1024, too small for the short-K rule
    assert "M=4096" in can(call(4096))[1]  # cuda_dequant above M = 2048
    assert "M=2049" in can(call(2049, k=2048, n=4096))[1]
    assert "M=257, N * K = 2097152" in can(call(257, k=2048, n=1024))[1]  # small layers: cuda_dequant from M = 257
    assert "layout 'v1'" in can(call(128, layout="v1"))[1]
    assert "float32" in can(call(128, dtype=torch.float32))[1]
    for m, k, n in ((9, 4096, 28672), (16, 5120, 27648), (17, 4096, 4096), (64, 4096, 28672), (65, 2048, 1024),
                    (33, 1024, 4096), (128, 1024, 4096), (192, 2048, 1024), (256, 4096, 4096), (512, 1024, 6144),
                    (256, 4096, 14336), (2048, 14336, 4096), (512, 4096, 4096), (256, 2048, 1024), (2048, 1024, 4096)):
        ok, why = can(call(m, k, n))
        assert ok or "extension not built" in why, (m, k, n, why)  # built on a GPU machine
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (8, 0))
    assert "no cuda_wgmma configs for default" in can(call(128))[1]  # only the sm90 table has it
    monkeypatch.setenv("TERNOP_BACKEND", "cuda_wgmma")  # forcing drops the floor and the shape rule, not the GPU
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (9, 0))
    ok, why = can(call(4096, k=1024, n=1024))
    assert ok or "extension not built" in why, why


def test_registry_cuda_mma_leaves_wide_layers_to_cuda_wgmma_from_m_9(monkeypatch):
    """cuda_mma goes first; at M = 9..16 it declines a wide layer only where cuda_wgmma takes it
    (here that answer is stubbed: the extension is not built on a CPU machine)."""
    from types import SimpleNamespace

    _sm90(monkeypatch)
    monkeypatch.delenv("TERNOP_BACKEND", raising=False)
    monkeypatch.delenv(backends.ENV_SKIP, raising=False)
    wgmma_can = [True]
    monkeypatch.setattr(registry, "_can_cuda_wgmma", lambda call: (wgmma_can[0], "" if wgmma_can[0] else "no"))

    def call(m, k=4096, n=28672, layout="a16"):
        x = SimpleNamespace(shape=(m, k), device=DEV, dtype=torch.bfloat16, data_ptr=lambda: 0, stride=lambda d: k)
        w = SimpleNamespace(shape=(n, k // 4), data_ptr=lambda: 0)
        return backends.LinearCall(x, w, None, None, 16, layout)

    def leaves(c):
        ok, why = registry._can_cuda_mma(c)
        assert ok or "cuda_wgmma is faster" in why or "extension not built" in why, why
        return "cuda_wgmma is faster" in why

    assert leaves(call(9)) and leaves(call(16)) and leaves(call(12, k=5120, n=27648)) and leaves(call(12, n=14336))
    assert not leaves(call(8)) and not leaves(call(16, n=4096)) and not leaves(call(16, k=1024, n=6144))
    assert not leaves(call(12, k=14336, n=4096)) and leaves(call(12, k=3584, n=37888))
    monkeypatch.setenv(backends.ENV_SKIP, "cuda_wgmma")
    assert not leaves(call(16))  # skipped: cuda_mma keeps it
    monkeypatch.delenv(backends.ENV_SKIP)
    wgmma_can[0] = False  # not Hopper, no sm_90a build, a v1 layout...
    assert not leaves(call(16))
    wgmma_can[0] = True
    monkeypatch.setenv("TERNOP_BACKEND", "cuda_mma")
    assert not leaves(call(16))  # forced


def test_wgmma_declines_follows_its_constants():
    # M = 9..16: the wide layers only (N >= 3K, N * K >= 2^25, K >= 2048)
    lo, hi = configs.WGMMA_WIDE_MIN_M, configs.WGMMA_WIDE_MAX_M
    k = configs.WGMMA_SMALL_M_MIN_K
    n = max(configs.WGMMA_WIDE_N_OVER_K * k, configs.WGMMA_WIDE_MIN_NK // k)
    assert configs.wgmma_declines(lo, n, k) == "" and configs.wgmma_declines(hi, n, k) == ""
    assert configs.wgmma_declines(lo - 1, n, k) != "" and configs.wgmma_declines(17, n, k) == ""
    assert configs.wgmma_declines(hi, n - 8, k) != ""  # N * K below 2^25
    square = 8192  # N * K = 2^26, but N < 3K
    assert configs.wgmma_declines(hi, square, square) != ""
    assert configs.wgmma_declines(hi, 1 << 16, 1024) != ""  # K = 1024
    assert configs.wgmma_declines(hi, 256 * 132 + 8, 4096) == ""  # more than one wave of an H200's CTAs
    # the measured shapes (results/h200/bench_linear_small_m_bc42e8a.json, sweep_wgmma_small_3c8c22a.json)
    for n, k in ((28672, 4096), (27648, 5120), (14336, 4096), (37888, 3584)):
        assert configs.wgmma_wide_layer(n, k), (n, k)
    for n, k in ((4096, 4096), (4096, 14336), (6144, 4096), (6912, 2560), (6144, 1024)):
        assert not configs.wgmma_wide_layer(n, k), (n, k)
    mid_k = configs.WGMMA_SMALL_M_MIN_K
    mid, short_from = configs.WGMMA_MID_M, configs.WGMMA_SHORT_K_MID_MIN_M
    assert configs.wgmma_declines(mid, configs.WGMMA_MID_MIN_NK // mid_k, mid_k) == ""
    assert configs.wgmma_declines(mid, configs.WGMMA_MID_MIN_NK // mid_k - 8, mid_k) != ""
    # K = 1024 up to M = 64: from M = 33 on layers with N * K >= 2^22 (1024 -> 4096, 1024 -> 6144)
    short_n = configs.WGMMA_SHORT_K_MID_MIN_NK // 1024
    assert configs.wgmma_declines(short_from, short_n, 1024) == ""
    assert configs.wgmma_declines(mid, short_n, 1024) == ""
    assert configs.wgmma_declines(short_from - 1, short_n, 1024) != ""
    assert configs.wgmma_declines(mid, short_n - 8, 1024) != ""
    assert configs.wgmma_declines(mid, 1024, 2048) != ""  # the N = 1024 layers keep cuda_mma_tiles
    # M = 65..2048: every layer, the small ones only up to WGMMA_SMALL_LAYER_MAX_M; above, the dequantizing path
    top, small_top = configs.WGMMA_MAX_M, configs.WGMMA_SMALL_LAYER_MAX_M
    for n, k in ((4096, 1024), (6144, 1024), (4096, 4096), (14336, 4096), (configs.WGMMA_SMALL_LAYER_NK // 128, 128)):
        assert configs.wgmma_declines(mid + 1, n, k) == "" and configs.wgmma_declines(top, n, k) == ""
        assert configs.wgmma_declines(top + 1, n, k) != ""
    for n, k in ((1024, 2048), (1024, 3072), (configs.WGMMA_SMALL_LAYER_NK // 128 - 8, 128)):
        assert configs.wgmma_declines(mid + 1, n, k) == "" and configs.wgmma_declines(small_top, n, k) == ""
        assert configs.wgmma_declines(small_top + 1, n, k) != "" and configs.wgmma_declines(top, n, k) != ""


def _hopper_ready(monkeypatch):
    """An sm_90a build on an H200 as far as the registry asks, with no GPU touched, and no engine's
    CUDA-graph bound left over from another test (an in-process vLLM engine sets it)."""
    _sm90(monkeypatch)
    monkeypatch.delenv("TERNOP_BACKEND", raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", None)
    monkeypatch.setattr(registry, "_cuda_ext_ready", lambda call, layouts: (True, ""))
    monkeypatch.setattr(registry, "_hopper_wgmma", lambda call: "")
    monkeypatch.setattr(registry, "_module", lambda name: (object(), ""))


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results"


def _cells(run: dict, field: str = "us") -> dict:
    """A bench_linear run's JSON as {(M, N, K): {impl: us}}, or another of its rows' fields
    (``speedup_vs_bf16``)."""
    import collections

    cells = collections.defaultdict(dict)
    for row in run["results"]:
        cells[(row["M"], row["N"], row["K"])][row["impl"]] = row[field]
    return cells


def _bench_cells(path: str, field: str = "us") -> dict:
    """A committed bench_linear run (``path`` under benchmarks/results/), as ``_cells`` gives it."""
    return _cells(json.loads((RESULTS / path).read_text()), field)


def _shape_call(m, k=4096, n=14336, scales=1, bits=8, layout="a8"):
    """A call of M rows on an N x K layer, as shapes only (nothing on a GPU)."""
    from types import SimpleNamespace

    x = SimpleNamespace(shape=(m, k), device=DEV, dtype=torch.bfloat16, data_ptr=lambda: 0, stride=lambda d: k)
    w = SimpleNamespace(shape=(n, k // 4), data_ptr=lambda: 0)
    return backends.LinearCall(x, w, SimpleNamespace(shape=(n, scales)), None, bits, layout)


def test_registry_cuda_dequant_a8_takes_dequant_a8s_calls(monkeypatch):
    """The C++ decode behind dequant_a8's GEMM runs wherever dequant_a8's rules would let dequant_a8
    run, and goes first; where those rules decline, it declines with their reason. Forced, it takes
    row-scaled int8 calls of any M (no block scales, no 16-bit activations, and not without the
    extension, where dequant_a8 runs instead). cuda_wgmma_a8 is skipped: where its shared-memory tile
    runs it goes before both (the next test)."""
    from ternop.cuda import cuda_ext

    def call(m, **kw):  # 1024 -> 4096
        return _shape_call(m, **{"k": 1024, "n": 4096, **kw})

    monkeypatch.setenv("TERNOP_SKIP_BACKENDS", "cuda_wgmma_a8")
    backends.clear_cache()
    _hopper_ready(monkeypatch)
    monkeypatch.setattr(cuda_ext, "load", lambda: (True, ""))
    monkeypatch.setattr(registry, "_module", lambda name: (object(), ""))
    order = [b.name for b in backends.available("cuda")]
    assert order.index("cuda_dequant_a8") < order.index("dequant_a8")
    for m in (700, 16384, 100):
        assert registry._can_cuda_dequant_a8(call(m))[0] == registry._can_dequant_a8(call(m))[0]
    assert registry._can_cuda_dequant_a8(call(16384)) == (True, "")
    ok, why = registry._can_cuda_dequant_a8(call(100))
    assert not ok and why.endswith("(dequant_a8's rules: the same GEMM)")
    assert why.startswith(registry._can_dequant_a8(call(100))[1])
    monkeypatch.setenv("TERNOP_BACKEND", "cuda_dequant_a8")
    for m in (1, 700, 16384):
        assert registry._can_cuda_dequant_a8(call(m)) == (True, "")
    ok, why = registry._can_cuda_dequant_a8(call(16384, scales=32))
    assert not ok and "one scale per row" in why
    ok, why = registry._can_cuda_dequant_a8(call(16384, bits=16, layout="a16"))
    assert not ok and "activation_bits=16" in why
    monkeypatch.delenv("TERNOP_BACKEND")
    monkeypatch.setattr(cuda_ext, "load", lambda: (False, "nvcc not found"))
    ok, why = registry._can_cuda_dequant_a8(call(16384))
    assert not ok and "extension not built: nvcc not found" in why
    assert registry._can_dequant_a8(call(16384)) == (True, "")


def test_registry_dense_int8_path_leaves_the_shared_memory_tiles_calls_to_it(monkeypatch):
    """With row scales, wherever cuda_wgmma_a8 takes its shared-memory tile (M >= 512, CTAs of 128 rows
    x 256 tokens that fill the GPU), the dense int8 path declines and says why, on the 8B layers and
    the 0.6B ones alike, and the kernel takes the call (triton_a8 is not preferred there); below that
    tile's reach (1024 -> 1152 at M = 4096: 144 CTAs, a second wave 9% full) the dense path keeps its
    calls. Without cuda_wgmma_a8 (skipped) it keeps them too."""
    from ternop.cuda import cuda_ext

    _hopper_ready(monkeypatch)
    monkeypatch.setenv("TERNOP_GRAPH_MAX_M", str(1 << 30))
    monkeypatch.setattr(cuda_ext, "load", lambda: (True, ""))
    monkeypatch.setattr(registry, "_module", lambda name: (object(), ""))
    for m, n, k in ((2048, 14336, 4096), (8192, 4096, 4096), (16384, 28672, 4096), (8192, 4096, 1024),
                    (8192, 1024, 3072), (2048, 6144, 1024)):  # fmt: skip
        assert configs.wgmma_a8_smem_takes(m, n, k, DEV), (m, n, k)
        ok, why = registry._can_cuda_dequant_a8(_shape_call(m, k=k, n=n))
        assert not ok and "decodes the weights into shared memory" in why, (m, n, k)
        assert registry._can_cuda_wgmma_a8(_shape_call(m, k=k, n=n)) == (True, ""), (m, n, k)
    assert not configs.wgmma_a8_smem_takes(512, 4096, 4096, DEV)
    assert not configs.wgmma_a8_smem_takes(4096, 1152, 1024, DEV)
    assert registry._can_cuda_dequant_a8(_shape_call(4096, k=1024, n=1152)) == (True, "")
    monkeypatch.setenv("TERNOP_SKIP_BACKENDS", "cuda_wgmma_a8")
    backends.clear_cache()
    assert registry._can_cuda_dequant_a8(_shape_call(8192, n=4096)) == (True, "")


def test_registry_cuda_wgmma_a8_runs_for_row_scales_or_when_forced(monkeypatch):
    """By GPU time under CUDA graphs (every M taken to be captured here), with a scale per 128 weights
    the int8 Hopper kernel did not beat triton_a8 on the H200, so the dispatcher passes it over with
    that reason even where everything it needs is present; forcing it still runs it. With a scale
    per row it takes the K >= 4096 layers from M = 17 where its 64-token CTAs of 128 rows fill 70%
    of the SMs (up to M = 64), at M = 65..128, and where its CTAs make one wave or leave no last wave
    under 80% full (M = 129..2047); of the shorter layers, every one at M = 129..256 and N <= 1024 at
    M = 129..2047."""
    _hopper_ready(monkeypatch)
    monkeypatch.setenv("TERNOP_GRAPH_MAX_M", str(1 << 30))
    call = _shape_call

    ok, why = registry._can_cuda_wgmma_a8(call(2048, scales=32))
    assert not ok and "not faster than triton_a8" in why and "TERNOP_BACKEND=cuda_wgmma_a8" in why
    # Row scales: 4096 -> 14336 makes 112 CTAs at M <= 64 (>= 93 of 132), 4096 -> 4096 only 32 up to 64
    # tokens (taken from M = 65), 96 at M = 129..192 (one wave, 73% full), 128 from M = 193 (97%), 160 at
    # M = 257..320 (two waves, the second 21% full).
    for m in (17, 64, 128, 256, 512, 2048):
        assert registry._can_cuda_wgmma_a8(call(m)) == (True, ""), m
    for m in (17, 64):
        ok, why = registry._can_cuda_wgmma_a8(call(m, n=4096))
        assert not ok and "under 70%" in why and "triton_a8 is faster" in why, m
    assert registry._can_cuda_wgmma_a8(call(65, n=4096)) == (True, "")
    assert registry._can_cuda_wgmma_a8(call(129, n=4096)) == (True, "")
    assert registry._can_cuda_wgmma_a8(call(193, n=4096)) == (True, "")
    assert "160 CTAs on 132 SMs fill their last wave" in registry._can_cuda_wgmma_a8(call(257, n=4096))[1]
    # 4096 -> 6144: 192 CTAs at M = 256 (64-token tile) and 512 (128-token tile) fill two waves to 73%;
    # 384 at M = 1024 fill three to 97%.
    for m in (256, 512):
        ok, why = registry._can_cuda_wgmma_a8(call(m, n=6144))
        assert not ok and "192 CTAs on 132 SMs fill their last wave to under 80%" in why, m
    assert registry._can_cuda_wgmma_a8(call(1024, n=6144)) == (True, "")
    ok, why = registry._can_cuda_wgmma_a8(call(16))
    assert not ok and "below M=17" in why
    ok, why = registry._can_cuda_wgmma_a8(call(1024, k=1024, n=4096))
    assert not ok and "triton_a8 is faster below K=4096" in why
    # Where the shared-memory tile runs (from M = 512, CTAs of 128 x 256 that fill the GPU), any K.
    assert registry._can_cuda_wgmma_a8(call(2048, k=1024, n=4096)) == (True, "")
    # The short-K layers: every one at M = 129..256, those of N <= 1024 on to M = 2047.
    for m, n in ((129, 1024), (224, 1024), (256, 1024), (1024, 1024), (2047, 1024), (129, 4096), (256, 4096)):
        assert registry._can_cuda_wgmma_a8(call(m, k=3072, n=n)) == (True, ""), (m, n)
    for m, n in ((128, 1024), (2048, 1024), (257, 4096), (512, 4096)):
        assert "triton_a8 is faster below K=4096" in registry._can_cuda_wgmma_a8(call(m, k=3072, n=n))[1], (m, n)
    monkeypatch.setenv("TERNOP_BACKEND", "cuda_wgmma_a8")
    assert registry._can_cuda_wgmma_a8(call(2048, scales=32)) == (True, "")
    assert registry._can_cuda_wgmma_a8(call(17, k=1024, n=4096)) == (True, "")
    assert "activation_bits=16" in registry._can_cuda_wgmma_a8(call(2048, scales=32, bits=16))[1]


def test_registry_dequant_a8_takes_row_scales_from_its_floor(monkeypatch):
    """dequant_a8 (decode to int8, dense int8 GEMM) runs 8-bit activations with one scale per row
    from M = 2048 on Hopper; block scales, 16-bit activations and smaller M go elsewhere, unless
    forced (then any M). It is tried before the other large-M int8 backends. cuda_wgmma_a8 is skipped
    here, so that its shared-memory tile (which takes 2048 x 4096 where it can run, as the test above
    shows) leaves these calls to the dense path on a GPU as on a CPU."""
    _sm90(monkeypatch)
    monkeypatch.setitem(configs._SM_COUNT_CACHE, 0, 132)
    monkeypatch.delenv("TERNOP_BACKEND", raising=False)
    monkeypatch.setenv("TERNOP_SKIP_BACKENDS", "cuda_wgmma_a8")
    backends.clear_cache()
    monkeypatch.setattr(registry, "_module", lambda name: (object(), ""))

    def call(m, scales=1, bits=8, n=4096):
        return _shape_call(m, 4096, n, scales, bits)

    floor = configs.min_m("dequant_a8", DEV)
    assert floor == 2048
    assert registry._can_dequant_a8(call(floor)) == (True, "")
    ok, why = registry._can_dequant_a8(call(floor - 1))
    assert not ok and f"M={floor - 1} is below M={floor}" in why
    ok, why = registry._can_dequant_a8(call(floor, scales=32))
    assert not ok and "one scale per row" in why
    ok, why = registry._can_dequant_a8(call(floor, bits=16))
    assert not ok and "activation_bits=16" in why
    # Too few 128 x 128 tiles to fill 132 SMs twice: 2048 x 1024 gives 128.
    ok, why = registry._can_dequant_a8(call(floor, n=1024))
    assert not ok and "128 tiles" in why and "132 SMs" in why
    assert registry._can_dequant_a8(call(4 * floor, n=1024)) == (True, "")
    monkeypatch.setenv("TERNOP_BACKEND", "dequant_a8")
    assert registry._can_dequant_a8(call(1)) == (True, "")
    order = [b.name for b in registry.BACKENDS if b.name in ("dequant_a8", "cuda_wgmma_a8", "triton_a8")]
    prio = {b.name: b.priority for b in registry.BACKENDS}
    assert sorted(order, key=lambda name: (prio[name], name)) == ["dequant_a8", "cuda_wgmma_a8", "triton_a8"]


def test_wgmma_a8_row_rule_picks_the_faster_kernel_of_its_run(monkeypatch):
    """configs.wgmma_a8_row_declines against the run it was chosen from (triton_a8 and cuda_wgmma_a8
    forced side by side with row scales on eleven 0.6B- and 8B-class layers, M = 17..1024, on an
    H200): at 75 of its 77 points the kernel the rule picks ran within 4% of the faster of the two.
    The two others, the K = 1024 layers at M = 256, are left to triton_a8 at 9% and 14% (its 0.51x
    and 0.53x of cuBLAS bf16 against 0.58x), where the Hopper kernel is behind on either side."""
    monkeypatch.setitem(configs._SM_COUNT_CACHE, 0, 132)
    cells = _bench_cells("h200/bench_linear_a8_mid_below_floors_e084e64.json")
    slow = {}
    for (m, n, k), times in cells.items():
        triton, wgmma = times["backend:triton_a8[a8 row]"], times["backend:cuda_wgmma_a8[a8 row]"]
        picked = triton if configs.wgmma_a8_row_declines(m, n, k, DEV) else wgmma
        slow[(m, n, k)] = picked / min(triton, wgmma)
    assert len(slow) == 77
    off = {point: s for point, s in slow.items() if s > 1.04}
    assert set(off) <= {(256, 4096, 1024), (256, 6144, 1024)}, off
    assert max(slow.values()) <= 1.15
    # Not one kernel everywhere: each takes a good share of the points.
    taken = sum(configs.wgmma_a8_row_declines(m, n, k, DEV) == "" for m, n, k in cells)
    assert 30 <= taken <= 50, taken


def test_wgmma_a8_row_rule_takes_one_wave_short_of_full_on_4096_to_4096(monkeypatch):
    """configs.wgmma_a8_row_declines against the run of 4096->4096 between M = 96 and 256 (both kernels
    forced with row scales, an H100): at M = 160..256 the kernel the rule picks ran within 4% of the
    faster one; at 160 and 192 (one wave of 96 CTAs) triton_a8 took twice as long. (At M = 96 and 128
    this run predates d190e12's cluster sums; the next test has the run the rule follows there.)"""
    monkeypatch.setitem(configs._SM_COUNT_CACHE, 0, 132)
    cells = _bench_cells("h100/bench_linear_a8row_4096_mid_6b4e389.json")
    assert sorted(m for m, _, _ in cells) == [96, 128, 160, 192, 224, 256]
    for (m, n, k), times in cells.items():
        triton, wgmma = times["backend:triton_a8[a8 row]"], times["backend:cuda_wgmma_a8[a8 row]"]
        picked = triton if configs.wgmma_a8_row_declines(m, n, k, DEV) else wgmma
        if m > 128:
            assert picked <= 1.04 * min(triton, wgmma), (m, picked, triton, wgmma)
    assert min(cells[(m, 4096, 4096)]["backend:triton_a8[a8 row]"] / cells[(m, 4096, 4096)]["backend:cuda_wgmma_a8[a8 row]"]
               for m in (160, 192)) > 1.9


def test_a8_fused_rule_picks_the_faster_path_of_its_run(monkeypatch):
    """configs.a8_fused_declines against the run it was chosen from (an H100, M = 1, row scales, the
    small-M kernel started early): on each of the eight layers the path it picks (the fused kernel,
    or the quantization launch + cuda_mma_a8) ran within 1% of the faster of the two, and it leaves
    the four 8B-class layers to the pair. Without the early start (TERNOP_PDL=0, or no sm_90) the
    fused kernel keeps every layer."""
    import json

    _sm90(monkeypatch)
    monkeypatch.delenv("TERNOP_PDL", raising=False)
    monkeypatch.setattr(configs, "_triton_has_gdc", lambda: True)
    run = RESULTS / "h100/bench_linear_pdl_on_cf1403c.json"
    times = {(row["N"], row["K"], row["impl"]): row["us"] for row in json.loads(run.read_text())["results"] if row["M"] == 1}
    layers = sorted({(n, k) for n, k, _ in times})
    assert len(layers) == 8
    pair_taken = []
    for n, k in layers:
        fused, pair = times[(n, k, "ternop_a8_row")], times[(n, k, "backend:cuda_mma_a8[a8 row]")]
        declines = configs.a8_fused_declines(n, k, DEV)
        picked = pair if declines else fused
        assert picked <= 1.01 * min(fused, pair), (n, k, fused, pair)
        if declines:
            pair_taken.append((n, k))
    assert pair_taken == [(4096, 4096), (4096, 14336), (14336, 4096), (28672, 4096)]  # (N, K)
    monkeypatch.setenv("TERNOP_PDL", "0")
    assert not any(configs.a8_fused_declines(n, k, DEV) for n, k in layers)
    monkeypatch.delenv("TERNOP_PDL")
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (8, 0))
    assert not any(configs.a8_fused_declines(n, k, DEV) for n, k in layers)


def test_triton_a8_starts_early_only_where_its_run_was_faster(monkeypatch):
    """configs.triton_a8_starts_early against the A/B run it was chosen from (one H100, the Triton
    int8 kernel forced, row scales, TERNOP_PDL=0 then 1): every cell it starts early ran faster
    started early, and every cell that ran more than 3% slower started early is one it launches
    plainly. Without the early start (TERNOP_PDL=0, or no sm_90) it starts nothing early."""
    _sm90(monkeypatch)
    monkeypatch.delenv("TERNOP_PDL", raising=False)
    monkeypatch.setattr(configs, "_triton_has_gdc", lambda: True)
    forced = "backend:triton_a8[a8 row]"
    off, on = ({cell: times[forced] for cell, times in _bench_cells(f"h100/bench_linear_early_{run}_4d94a8d.json").items()
                if forced in times} for run in ("off", "on"))  # fmt: skip
    assert len(off) == len(on) == 64
    early = [cell for cell in on if configs.triton_a8_starts_early(cell[0], cell[2], DEV)]
    assert len(early) == 48  # M = 1..128 on the seven layers with K <= 4096; M = 256, 512 on the three with K <= 2048
    assert all(on[cell] < off[cell] for cell in early), [(c, on[c] / off[c]) for c in early if on[c] >= off[c]]
    slower = {cell for cell in on if on[cell] > 1.03 * off[cell]}
    assert slower and not slower & set(early), slower
    monkeypatch.setenv("TERNOP_PDL", "0")
    assert not any(configs.triton_a8_starts_early(m, k, DEV) for m, _, k in on)
    monkeypatch.delenv("TERNOP_PDL")
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (8, 0))
    assert not any(configs.triton_a8_starts_early(m, k, DEV) for m, _, k in on)


def test_registry_row_a8_above_the_graphs_goes_to_the_one_cpp_launch(monkeypatch):
    """A row-scaled int8 call above vLLM's CUDA-graph sizes (M > 512) and up to M * N * K = 2^33 goes to
    cuda_wgmma_a8, whose one launch from C++ costs less host time than dequant_a8's two Triton
    launches or triton_a8's one. At the graphs' M, above that product, with block scales, with the
    Hopper kernel skipped, or with dequant_a8 forced, the choice is the table's. TERNOP_GRAPH_MAX_M
    moves the graphs' bound, and a bad value is refused by name."""
    _hopper_ready(monkeypatch)
    monkeypatch.delenv("TERNOP_GRAPH_MAX_M", raising=False)
    call = _shape_call
    assert configs.graph_max_m() == configs.GRAPH_MAX_M == 512
    top = configs.EAGER_A8_ROW_MAX_MNK // (4096 * 1024)  # 4096 on 1024 -> 4096
    for m in (513, 1024, 2048, top):
        assert registry._can_cuda_wgmma_a8(call(m, k=1024, n=4096)) == (True, ""), m
    for m in (64, 512, top + 1):  # the graphs' M: triton_a8 leads on these K = 1024 layers; past the product
        ok, why = registry._can_cuda_wgmma_a8(call(m, k=1024, n=4096))
        assert not ok and "triton_a8 is faster below K=4096" in why, m
    assert "not faster than triton_a8" in registry._can_cuda_wgmma_a8(call(2048, k=1024, n=4096, scales=8))[1]
    # dequant_a8 would take 2304 x 2048 (288 tiles for 132 SMs, under 2^33) and leaves it to the Hopper
    # kernel (not its shared-memory tile: 144 CTAs fill a second wave to 9%); 2304 x 4096 (2^33.2) is
    # past the product: the kernels' time. Where the shared-memory tile runs (2048 x 4096, 8192 x 6144)
    # the kernel takes the call in any case.
    ok, why = registry._can_dequant_a8(call(2304, k=1024, n=2048))
    assert not ok and "runs outside CUDA graphs" in why and "EAGER_A8_ROW_MAX_MNK" in why
    assert registry._can_dequant_a8(call(2304, k=1024, n=4096)) == (True, "")
    for m, n in ((2048, 4096), (8192, 6144)):
        ok, why = registry._can_dequant_a8(call(m, k=1024, n=n))
        assert not ok and "configs.wgmma_a8_smem_takes" in why, (m, n)
    monkeypatch.setenv("TERNOP_SKIP_BACKENDS", "cuda_wgmma_a8")
    assert registry._can_dequant_a8(call(2304, k=1024, n=2048)) == (True, "")
    monkeypatch.delenv("TERNOP_SKIP_BACKENDS")
    monkeypatch.setenv("TERNOP_BACKEND", "dequant_a8")
    assert registry._can_dequant_a8(call(2304, k=1024, n=2048)) == (True, "")
    monkeypatch.delenv("TERNOP_BACKEND")
    monkeypatch.setenv("TERNOP_GRAPH_MAX_M", "2304")  # a larger capture size: 2304 is a graph's M now
    assert registry._can_dequant_a8(call(2304, k=1024, n=2048)) == (True, "")
    assert "triton_a8 is faster below K=4096" in registry._can_cuda_wgmma_a8(call(2304, k=1024, n=2048))[1]
    monkeypatch.setenv("TERNOP_GRAPH_MAX_M", "2048")
    # One row past the bound the call is eager: on 2048 -> 1024 (2^32) the Hopper kernel takes it, where
    # inside a graph the table leaves it to triton_a8.
    assert registry._can_cuda_wgmma_a8(call(2049, k=2048, n=1024)) == (True, "")
    monkeypatch.setenv("TERNOP_GRAPH_MAX_M", "2049")
    assert "on N <= 1024 at M = 129..2047" in registry._can_cuda_wgmma_a8(call(2049, k=2048, n=1024))[1]
    for bad in ("lots", "-1"):
        monkeypatch.setenv("TERNOP_GRAPH_MAX_M", bad)
        with pytest.raises(ValueError, match="TERNOP_GRAPH_MAX_M"):
            registry._can_cuda_wgmma_a8(call(2048, k=1024, n=4096))


def test_eager_a8_row_rule_picks_the_faster_path_of_its_probe(monkeypatch):
    """configs.EAGER_A8_ROW_MAX_MNK against the probe it was last set from (50 eager calls in a row of
    each int8 backend, forced, on the embedder's four layers at M = 2048, 8192 and 16384 on an H200,
    after cuda_dequant_a8 took dequant_a8's calls): at every point above the graphs' M the rule's side
    finished its calls first. Where the rule takes cuda_wgmma_a8, cuda_dequant_a8 (the table's pick
    without the rule) took at least 1.5x as long; where it does not, cuda_wgmma_a8 took longer than
    cuda_dequant_a8, and the registry lets the dense path take the call. The probe ran before the
    kernel's shared-memory tile; where that tile runs now, the kernel takes the call whatever the rule
    says (configs.wgmma_a8_smem_takes), and the probe's times of the kernel are not the tile's."""
    import json

    _hopper_ready(monkeypatch)
    monkeypatch.delenv("TERNOP_GRAPH_MAX_M", raising=False)
    run = RESULTS / "h200/probe_host_call_a8_3070b64.json"
    points = ruled = tiled = 0
    for row in json.loads(run.read_text())["results"]:
        m, n, k = row["M"], row["N"], row["K"]
        if m <= configs.GRAPH_MAX_M:
            continue  # run inside CUDA graphs, where host time is not paid
        wall = {name: t["gpu_us"] for name, t in row["by_backend"].items()}
        cpp, dense = wall["cuda_wgmma_a8"], wall["cuda_dequant_a8"]
        if configs.wgmma_a8_smem_takes(m, n, k, DEV):
            ok, why = registry._can_dequant_a8(_shape_call(m, k=k, n=n))
            assert not ok and "configs.wgmma_a8_smem_takes" in why, (m, n, k)
            tiled += 1
        elif configs.eager_a8_row_host_bound(m, n, k):
            assert dense >= 1.5 * cpp, (m, n, k, cpp, dense)
            assert not registry._can_dequant_a8(_shape_call(m, k=k, n=n))[0], (m, n, k)
            ruled += 1
        else:
            assert cpp > dense, (m, n, k, cpp, dense)
            assert registry._can_dequant_a8(_shape_call(m, k=k, n=n)) == (True, ""), (m, n, k)
        points += 1
    assert (points, ruled, tiled) == (12, 2, 10), (points, ruled, tiled)


def test_the_engine_sets_the_graphs_bound_and_the_environment_overrides_it(monkeypatch):
    """set_graph_max_m (what the vLLM plugin calls with the engine's max_cudagraph_capture_size) moves the
    bound the int8 rule starts from, forgets the choices made under the old one, and refuses a bad
    value; TERNOP_GRAPH_MAX_M wins over it; None goes back to GRAPH_MAX_M."""
    monkeypatch.delenv("TERNOP_GRAPH_MAX_M", raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", None)
    assert configs.graph_max_m() == configs.GRAPH_MAX_M
    monkeypatch.setitem(backends._CHOICE, ("a cached choice",), None)
    configs.set_graph_max_m(128)
    assert configs.graph_max_m() == 128 and not backends._CHOICE
    assert configs.eager_a8_row_host_bound(129, 4096, 1024) and not configs.eager_a8_row_host_bound(128, 4096, 1024)
    configs.set_graph_max_m(0)  # an engine that captures no graph: every call is eager
    assert configs.eager_a8_row_host_bound(1, 4096, 1024)
    monkeypatch.setenv("TERNOP_GRAPH_MAX_M", "1024")
    assert configs.graph_max_m() == 1024
    monkeypatch.delenv("TERNOP_GRAPH_MAX_M")
    for bad in (-1, 2.5, True, "512"):
        with pytest.raises(ValueError, match="whole number of tokens"):
            configs.set_graph_max_m(bad)
    configs.set_graph_max_m(None)
    assert configs.graph_max_m() == configs.GRAPH_MAX_M


def test_registry_16_bit_calls_above_the_graphs_go_to_the_one_cpp_launch(monkeypatch):
    """Above vLLM's CUDA-graph sizes a 16-bit call with M * N * K up to 2^33 goes to cuda_wgmma where the
    table would leave it to the dequantizing path (the N = 1024 layers above M = 256, every layer above
    2048); under the graphs' bound, past that product, or at M <= 64 (where the other candidates are C++
    launches too) the table decides."""
    _hopper_ready(monkeypatch)
    monkeypatch.delenv("TERNOP_GRAPH_MAX_M", raising=False)

    def call(m, k=2048, n=1024):
        return _shape_call(m, k, n, scales=k // 128, bits=16, layout="a16")

    top = configs.EAGER_A16_MAX_MNK // (2048 * 1024)  # 4096 on 2048 -> 1024
    assert configs.wgmma_declines(2048, 1024, 2048)  # the table's choice: cuda_dequant
    for m in (513, 2048, top):
        assert registry._can_cuda_wgmma(call(m)) == (True, ""), m
    for m in (300, 512, top + 1):
        ok, why = registry._can_cuda_wgmma(call(m))
        assert not ok and "faster above" in why, m
    wide = configs.EAGER_A16_MAX_MNK // (4096 * 1024)  # 1024 -> 4096: the table stops at WGMMA_MAX_M = 2048
    assert wide == configs.WGMMA_MAX_M and "M = 2048" in registry._can_cuda_wgmma(call(wide + 1, 1024, 4096))[1]
    configs.set_graph_max_m(0)  # no graphs at all: still the table's up to WGMMA_MID_M
    assert registry._can_cuda_wgmma(call(40, k=1024, n=1024)) == (False, configs.wgmma_declines(40, 1024, 1024))
    assert registry._can_cuda_wgmma(call(300)) == (True, "")
    monkeypatch.setenv("TERNOP_GRAPH_MAX_M", str(1 << 30))
    assert "faster above" in registry._can_cuda_wgmma(call(2048))[1]


def test_eager_a16_rule_picks_the_faster_path_of_its_probe(monkeypatch):
    """configs.EAGER_A16_MAX_MNK against the probe it was set from (the 16-bit call, every backend forced,
    on the embedder's four layers at M = 2048 and 16384): where the rule moves a call from the table's
    backend to cuda_wgmma (the N = 1024 layers at 2048), the table's took 2.0-2.4x as long; above the
    bound (16384) the table's cuda_dequant finished first on every layer."""
    import json

    monkeypatch.delenv("TERNOP_GRAPH_MAX_M", raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", None)
    run = RESULTS / "h200/probe_host_call_24815a1.json"
    moved = kept = 0
    for row in json.loads(run.read_text())["results"]:
        m, n, k = row["M"], row["N"], row["K"]
        wall = {name: t["gpu_us"] for name, t in row["by_backend"].items()}
        if row["backend"] == "cuda_wgmma":
            continue  # the table runs it there already
        if configs.eager_a16_host_bound(m, n, k):
            assert wall[row["backend"]] >= 1.5 * wall["cuda_wgmma"], (m, n, k)
            moved += 1
        else:
            assert wall[row["backend"]] < wall["cuda_wgmma"], (m, n, k)
            kept += 1
    assert (moved, kept) == (2, 4)


def test_wgmma_a8_row_rule_takes_the_n_1024_layers_since_the_cluster_sums(monkeypatch):
    """Since d190e12 (the split-K cluster sums of cuda_wgmma_a8 load every rank before adding) the
    Hopper kernel ran ahead of triton_a8, or level, on both N = 1024 layers at every M = 192..1024
    that timed them (forced, row scales, with the quantization, triton_a8 started early where it
    does; one H100): the rule gives it every one of those calls. Before, started early, triton_a8
    had overtaken it on 2048->1024 at M = 256 and 512 (bench_linear_early_on_4d94a8d.json), by 10-12%."""
    _sm90(monkeypatch)
    monkeypatch.delenv("TERNOP_PDL", raising=False)
    monkeypatch.setattr(configs, "_triton_has_gdc", lambda: True)
    monkeypatch.setitem(configs._SM_COUNT_CACHE, 0, 132)
    triton_row, wgmma_row = "backend:triton_a8[a8 row]", "backend:cuda_wgmma_a8[a8 row]"
    points = {}
    for run in ("h100/bench_linear_split_sums_d190e12.json", "h100/bench_linear_a8row_n1024_01fdd22.json"):
        for cell, times in _bench_cells(run).items():
            if cell[1] == 1024 and cell[0] > 128:
                points[cell] = times
    assert sorted({m for m, _, _ in points}) == [192, 256, 320, 384, 448, 512, 768, 1024]
    assert sorted({k for _, _, k in points}) == [2048, 3072]
    for (m, n, k), times in points.items():
        assert times[wgmma_row] <= 1.02 * times[triton_row], (m, k, times[wgmma_row], times[triton_row])
        assert configs.wgmma_a8_row_declines(m, n, k, DEV) == "", (m, k)
    # Where triton_a8 started early had overtaken the kernel before: now well behind at 512.
    assert points[(512, 1024, 2048)][triton_row] > 1.1 * points[(512, 1024, 2048)][wgmma_row]
    before = _bench_cells("h100/bench_linear_early_on_4d94a8d.json")[(512, 1024, 2048)]
    assert before[triton_row] < 0.92 * before[wgmma_row]


def test_mma_a8_four_tiles_take_m_17_to_32_where_their_run_was_faster(monkeypatch):
    """cuda_mma_a8's four token tiles against what the dispatcher picked before (one H100, forced,
    with the quantization, M = 17, 24, 32 on the eight layers): with row scales the rule's pick ran
    within 1% of the faster at every point, and its own kernel ran 3-33% faster wherever it takes the
    call; with block scales it beat triton_a8 everywhere. On Hopper the registry takes M <= 32 but
    row-scaled M > 20 on N * K >= 2^26 (cuda_wgmma_a8 goes there); other GPUs keep M <= 16."""
    _hopper_ready(monkeypatch)
    cells = _bench_cells("h100/bench_linear_mma_a8_four_tiles_b5b99db.json")
    points = [cell for cell in cells if cell[0] > 16]
    assert len(points) == 24
    for m, n, k in points:
        times = cells[(m, n, k)]
        mma, before = times["backend:cuda_mma_a8[a8 row]"], times["ternop_a8_row"]
        declines = configs.mma_a8_declines(m, n, k, row_scales=True)
        assert (declines != "") == (n * k >= 1 << 26 and m > 20), (m, n, k)
        picked = before if declines else mma
        assert picked <= 1.01 * min(mma, before), (m, n, k, mma, before)
        if not declines:
            assert mma < 0.98 * before, (m, n, k, mma, before)
        assert times["backend:cuda_mma_a8[a8]"] < times["backend:triton_a8[a8]"], (m, n, k)
        assert configs.mma_a8_declines(m, n, k, row_scales=False) == ""
    assert registry._can_cuda_mma_a8(_shape_call(32, k=1024, n=4096)) == (True, "")
    assert registry._can_cuda_mma_a8(_shape_call(20, k=4096, n=28672)) == (True, "")
    ok, why = registry._can_cuda_mma_a8(_shape_call(24, k=4096, n=28672))
    assert not ok and "mma_a8_declines" in why
    assert registry._can_cuda_mma_a8(_shape_call(24, k=4096, n=28672, scales=32)) == (True, "")
    ok, why = registry._can_cuda_mma_a8(_shape_call(33, k=1024, n=4096, scales=8))
    assert not ok and "M <= 32 with block scales" in why
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (8, 0))
    ok, why = registry._can_cuda_mma_a8(_shape_call(17, k=1024, n=4096))
    assert not ok and "M <= 16" in why


def test_mma_a8_eight_tiles_take_m_33_to_64_on_k_1024_where_their_run_was_faster(monkeypatch):
    """cuda_mma_a8's eight token tiles (row scales only) against what the dispatcher picked before
    (one H100, forced, with the quantization, M = 33, 40, 48, 64 on the eight layers): on the K = 1024
    layers faster or level at every point, from K = 2048 level at one point and slower at the rest.
    The rule's pick is within 1% of the faster at all 32 points; block scales stay at M <= 32, and
    M = 65 goes elsewhere where no token slabs take it."""
    _hopper_ready(monkeypatch)
    cells = _bench_cells("h100/bench_linear_mma_a8_eight_tiles_b3151bc.json")
    assert len(cells) == 32 and all(m > 32 for m, _, _ in cells)
    for m, n, k in cells:
        times = cells[(m, n, k)]
        mma, before = times["backend:cuda_mma_a8[a8 row]"], times["ternop_a8_row"]
        declines = configs.mma_a8_declines(m, n, k, row_scales=True)
        assert (declines != "") == (k > 1024), (m, n, k)
        picked = before if declines else mma
        assert picked <= 1.01 * min(mma, before), (m, n, k, mma, before)
        if not declines and m <= 48:
            assert mma < 0.93 * before, (m, n, k, mma, before)
    assert registry._can_cuda_mma_a8(_shape_call(64, k=1024, n=6144)) == (True, "")
    ok, why = registry._can_cuda_mma_a8(_shape_call(33, k=4096, n=4096))
    assert not ok and "mma_a8_declines" in why
    ok, why = registry._can_cuda_mma_a8(_shape_call(65, k=1024, n=16384))  # no token slabs there either
    assert not ok and "M <= 64 with row scales" in why


def _bench_speedups(path: str, impl: str) -> dict:
    """One implementation's speed-ups over cuBLAS bf16 in a committed bench_linear run, {(M, N, K): x}."""
    cells = _bench_cells(path, "speedup_vs_bf16")
    return {cell: row[impl] for cell, row in cells.items() if impl in row}


@pytest.mark.parametrize("mode", ["a16", "a8"])
def test_token_slabs_run_where_their_run_was_faster(monkeypatch, mode):
    """The token-slab rules against their forced runs (one H100; each slab size in a process of its own
    with the dispatcher of then beside it, M = 24..64 and for int8 to 128 on 1024->4096, 1024->6144,
    2048->1024, 3072->1024 and 4096->4096). Where a rule picks a slab, that slab ran at least 3% faster
    than the dispatcher; at every point the pick is within 5% of the fastest thing measured there. These
    runs left the sets of rows a CTA to the kernel: where the int8 rule sets them (M = 65..128 on the
    N >= K layers), test_int8_sets_of_rows_at_m_65_to_128_follow_their_probe holds it."""
    _hopper_ready(monkeypatch)
    if mode == "a16":
        before = _bench_speedups("h100/exp_slabs_a16_base_ea6f08d.json", "ternop")
        slabs = {s: _bench_speedups(f"h100/exp_slabs_a16_slab{s}_ea6f08d.json", "backend:cuda_mma[a16]") for s in (8, 16)}

        def rule(m, n, k):
            return configs.mma_slab(m, n, k, DEV)
    else:
        before = _bench_speedups("h100/exp_slabs_a8_base_ea6f08d.json", "ternop_a8_row")
        slabs = {s: _bench_speedups(f"h100/exp_slabs_a8_slab{s}_ea6f08d.json", "backend:cuda_mma_a8[a8 row]")
                 for s in (16, 32)}  # fmt: skip

        def rule(m, n, k):
            return configs.mma_a8_slab(m, n, k, True, DEV)
    points = [cell for cell in before if cell[0] > 16]
    assert len(points) == (25 if mode == "a16" else 35)
    own_sets = [cell for cell in points if mode == "a16" or configs.mma_a8_row_groups(*cell, True, DEV) == -1]
    assert len(own_sets) == (25 if mode == "a16" else 31)
    picked = 0
    for m, n, k in own_sets:
        slab = rule(m, n, k)
        best = max([before[(m, n, k)]] + [run[(m, n, k)] for run in slabs.values() if (m, n, k) in run])
        pick = slabs[slab][(m, n, k)] if slab else before[(m, n, k)]
        if slab:
            picked += 1
            assert pick > 1.03 * before[(m, n, k)], (m, n, k, slab, pick, before[(m, n, k)])
        assert pick >= 0.95 * best, (m, n, k, slab, pick, best)
    assert picked == (11 if mode == "a16" else 21)


def _probe_by_slab(path: str, prefix: str) -> dict:
    """A committed probe_slabs.py run as {(M, N, K): {slab: speed-up over cuBLAS bf16}} for the
    implementations ``{prefix}{slab}`` (the kernel's own sets of rows a CTA; ``_r{sets}`` ones left out)."""
    return {cell: {int(impl[len(prefix):]): x for impl, x in row.items() if impl.startswith(prefix) and "_r" not in impl}
            for cell, row in _bench_cells(path, "speedup_vs_bf16").items()}  # fmt: skip


@pytest.mark.parametrize("mode", ["a16", "a8"])
def test_token_slabs_at_the_m_the_forced_runs_left_out_follow_their_probe(monkeypatch, mode):
    """probe_slabs.py (one H100; the two ops called directly with every slab size) at M = 9, 12, 16 and
    65..128. At M <= 16: where a rule picks slabs of 8 they beat one CTA column by 4% or more, and where
    it picks none one column was at least as fast. At M = 65..128: no 16-bit slab is taken, and each
    int8 slab picked with the kernel's own sets of rows was the fastest size measured there or within 3%
    of it (the probe had no other sets; where the rule sets them, the a368b8d probe holds it)."""
    _hopper_ready(monkeypatch)
    cells = _probe_by_slab("h100/probe_slabs_86dc310.json", f"{mode}_slab" if mode == "a16" else "a8row_slab")
    assert len(cells) == 35
    taken = 0
    for (m, n, k), by_slab in cells.items():
        slab = configs.mma_slab(m, n, k, DEV) if mode == "a16" else configs.mma_a8_slab(m, n, k, True, DEV)
        if mode == "a8" and configs.mma_a8_row_groups(m, n, k, True, DEV) != -1:
            continue
        if m > 64:
            assert mode == "a8" or slab == 0, (m, n, k, slab)
            if slab:
                taken += 1
                assert by_slab[slab] >= 0.97 * max(by_slab.values()), (m, n, k, slab, by_slab)
            continue
        if slab:
            taken += 1
            assert slab == 8 and by_slab[8] >= 1.04 * by_slab[0], (m, n, k, by_slab)
        else:
            assert by_slab[0] >= by_slab[8], (m, n, k, by_slab)
    assert taken == (6 if mode == "a16" else 9 + 8)


def _a8_probe_pick(path: str) -> list[tuple]:
    """For each cell of an int8 slab probe: (cell, the speed-up of what the rules pick, the fastest
    implementation's). The rules pick a slab (configs.mma_a8_slab; 0 is one CTA column) and sets of 16
    rows a CTA (configs.mma_a8_row_groups; -1 the kernel's own), which the probe names
    ``a8row_slab{slab}`` and ``a8row_slab{slab}_r{sets}``; None where they take no slab past M = 64."""
    picks = []
    for (m, n, k), row in _bench_cells(path, "speedup_vs_bf16").items():
        a8 = {impl: x for impl, x in row.items() if impl.startswith("a8row_slab")}
        slab, sets = configs.mma_a8_slab(m, n, k, True, DEV), configs.mma_a8_row_groups(m, n, k, True, DEV)
        taken = slab or m <= registry.CUDA_MMA_A8_ROW_MAX_M
        name = f"a8row_slab{slab}" + ("" if sets == -1 else f"_r{sets}")
        picks.append(((m, n, k), a8[name] if taken else None, max(a8.values())))
    return picks


def test_int8_slab_rules_still_pick_the_fastest_slab_after_the_row_scaled_epilogues_changed(monkeypatch):
    """probe_slabs.py again after f6f4718 made the int8 row-scaled epilogue faster (one H100; int8 rows
    quantized beforehand), on the K = 1024 layers at M = 33, 48, 64 and 96, each slab with the kernel's
    own sets of rows a CTA and with 2, 4 and 8 forced. What the rules pick (a slab, or one CTA column at
    M <= 64, and the sets) was the fastest of all of them or within 3%."""
    _hopper_ready(monkeypatch)
    picks = _a8_probe_pick("h100/probe_slabs_f6f4718.json")
    assert len(picks) == 8
    for cell, pick, best in picks:
        assert pick is not None and pick >= 0.97 * best, (cell, pick, best)


def test_int8_sets_of_rows_at_m_65_to_128_follow_their_probe(monkeypatch):
    """probe_slabs.py at a368b8d (one H100; int8 rows quantized beforehand) on the four 0.6B layers at
    M = 65, 80, 96, 112 and 128, each slab with the kernel's own sets of rows a CTA and with 1, 2 and 4
    forced. The rules take a slab at every point, and what they pick was the fastest or within 3%. On
    the N >= K layers that is more sets than the kernel's own, which took at least 25% longer at every
    point there; on the N < K layers the kernel's own sets."""
    _hopper_ready(monkeypatch)
    own_sets = _probe_by_slab("h100/probe_slabs_mid_a368b8d.json", "a8row_slab")
    picks = _a8_probe_pick("h100/probe_slabs_mid_a368b8d.json")
    assert len(picks) == 20
    for (m, n, k), pick, best in picks:
        assert pick is not None and pick >= 0.97 * best, ((m, n, k), pick, best)
        sets = configs.mma_a8_row_groups(m, n, k, True, DEV)
        assert (sets != -1) == (n >= k), (m, n, k, sets)
        if sets != -1:
            own = max(own_sets[(m, n, k)].values())
            assert pick >= 1.25 * own, ((m, n, k), pick, own)


def test_token_slabs_take_their_layers_through_the_registry(monkeypatch):
    """The registry gives cuda_mma and cuda_mma_a8 the calls their slab rules take, past the one-launch
    M (16; 32 with block scales, 64 with row scales), and passes the slab (and, to cuda_mma_a8, the sets
    of rows a CTA) to the op; the other layers, block scales, v1 weights and GPUs before Hopper keep the
    old bounds. Forced, they take any M in slabs of 16."""
    _hopper_ready(monkeypatch)
    seen, sets = [], []
    monkeypatch.setattr(torch.ops.ternop, "linear_cuda_mma", lambda *a, slab: seen.append(slab))
    monkeypatch.setattr(torch.ops.ternop, "linear_cuda_mma_a8",
                        lambda *a, row_groups, slab: (seen.append(slab), sets.append(row_groups)))
    monkeypatch.setattr(registry, "_contiguous", lambda call: (call.x, call.weight_packed, call.weight_scale, None))
    monkeypatch.setattr(registry, "_quantized", lambda call: (call.x, None, call.weight_packed, call.weight_scale, None))
    a16 = dict(bits=16, layout="a16", scales=8)
    registry._run_cuda_mma(_shape_call(40, k=3072, n=1024, **a16))
    registry._run_cuda_mma(_shape_call(9, k=1024, n=6144, **a16))
    registry._run_cuda_mma_a8(_shape_call(128, k=3072, n=1024))
    registry._run_cuda_mma_a8(_shape_call(2, k=3072, n=1024))
    registry._run_cuda_mma_a8(_shape_call(100, k=1024, n=4096))
    registry._run_cuda_mma_a8(_shape_call(72, k=1024, n=6144))
    registry._run_cuda_mma_a8(_shape_call(100, k=1024, n=6144, scales=8))  # block scales: neither
    assert seen == [8, 0, 32, 0, 32, 16, 0]
    assert sets == [-1, -1, 2, 4, -1]
    assert registry._can_cuda_mma(_shape_call(24, k=2048, n=1024, **a16)) == (True, "")
    assert registry._cuda_mma_slab(_shape_call(24, k=2048, n=1024, **a16)) == 16
    assert registry._cuda_mma_slab(_shape_call(40, k=3072, n=1024, **a16)) == 8
    assert registry._cuda_mma_slab(_shape_call(64, k=2048, n=1024, **a16)) == 16
    assert registry._cuda_mma_slab(_shape_call(16, k=2048, n=1024, **a16)) == 8
    assert registry._cuda_mma_slab(_shape_call(16, k=1024, n=4096, **a16)) == 0
    assert registry._cuda_mma_slab(_shape_call(8, k=2048, n=1024, **a16)) == 0
    for m, k, n in [(33, 1024, 4096), (64, 3072, 1024), (24, 1024, 6144), (65, 2048, 1024)]:
        ok, why = registry._can_cuda_mma(_shape_call(m, k=k, n=n, **a16))
        assert not ok and "configs.mma_slab" in why, (m, k, n, why)
    ok, why = registry._can_cuda_mma(_shape_call(24, k=2048, n=1024, bits=16, layout="v1", scales=16))
    assert not ok and "M <= 16" in why
    a8 = dict(k=1024, n=4096)
    assert registry._cuda_mma_a8_slab(_shape_call(24, **a8)) == 16
    assert registry._cuda_mma_a8_slab(_shape_call(64, **a8)) == 32
    assert registry._cuda_mma_a8_slab(_shape_call(128, k=3072, n=1024)) == 32
    assert registry._can_cuda_mma_a8(_shape_call(128, k=3072, n=1024)) == (True, "")
    assert registry._can_cuda_mma_a8(_shape_call(96, k=2048, n=1024)) == (True, "")  # past mma_a8_declines' K
    assert registry._cuda_mma_a8_slab(_shape_call(24, k=1024, n=4096, scales=8)) == 0  # block scales
    assert registry._cuda_mma_a8_slab(_shape_call(96, **a8)) == 32
    assert registry._cuda_mma_a8_slab(_shape_call(12, **a8)) == 8
    assert registry._can_cuda_mma_a8(_shape_call(128, **a8)) == (True, "")
    ok, why = registry._can_cuda_mma_a8(_shape_call(129, **a8))
    assert not ok and "configs.mma_a8_slab" in why
    assert registry._cuda_mma_a8_slab(_shape_call(24, k=4096, n=4096)) == 0
    monkeypatch.setenv("TERNOP_BACKEND", "cuda_mma")
    assert registry._cuda_mma_slab(_shape_call(200, k=4096, n=4096, **a16)) == 16
    monkeypatch.setenv("TERNOP_BACKEND", "cuda_mma_a8")
    assert registry._cuda_mma_a8_slab(_shape_call(200, k=4096, n=4096)) == 16
    assert registry._cuda_mma_a8_slab(_shape_call(40, k=4096, n=4096)) == 0  # the eight-tile kernel takes it
    monkeypatch.delenv("TERNOP_BACKEND")
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (8, 0))
    assert registry._cuda_mma_slab(_shape_call(24, k=2048, n=1024, **a16)) == 0
    assert registry._cuda_mma_a8_slab(_shape_call(24, **a8)) == 0


def test_token_slab_rules_give_only_slabs_the_ops_take(monkeypatch):
    """Over every M to 256 and a spread of layers, the rules return 0 or a slab the op takes (8 or 16;
    int8 also 32) that is smaller than M, never one past their bucket's largest M, and nothing on other
    GPUs or with block scales. The int8 sets of rows a CTA are the kernel's own (-1), or 2 or 4 where an
    int8 slab is taken."""
    _sm90(monkeypatch)
    layers = [(n, k) for n in (256, 1024, 2048, 3072, 4096, 6144, 14336) for k in (512, 1024, 2048, 3072, 4096)]
    seen = set()
    for m in range(1, 257):
        for n, k in layers:
            a16, a8 = configs.mma_slab(m, n, k, DEV), configs.mma_a8_slab(m, n, k, True, DEV)
            assert a16 in (0, 8, 16) and (a16 == 0 or (a16 < m <= configs.SLAB_A16_MAX_M)), (m, n, k, a16)
            assert a8 in (0, 8, 16, 32) and (a8 == 0 or (a8 < m <= configs.SLAB_A8_MAX_M)), (m, n, k, a8)
            assert configs.mma_a8_slab(m, n, k, False, DEV) == 0
            sets = configs.mma_a8_row_groups(m, n, k, True, DEV)
            assert sets == -1 or (sets in (2, 4) and a8 > 0), (m, n, k, a8, sets)
            assert configs.mma_a8_row_groups(m, n, k, False, DEV) == -1
            seen.update({("a16", a16), ("a8", a8), ("sets", sets)})
    assert seen == {("a16", 0), ("a16", 8), ("a16", 16), ("a8", 0), ("a8", 8), ("a8", 16), ("a8", 32),
                    ("sets", -1), ("sets", 2), ("sets", 4)}
    monkeypatch.setitem(configs._CAPABILITY_CACHE, 0, (8, 9))
    assert configs.mma_slab(24, 1024, 2048, DEV) == 0 and configs.mma_a8_slab(24, 1024, 2048, True, DEV) == 0
    assert configs.mma_a8_slab(96, 4096, 1024, True, DEV) == 0 and configs.mma_a8_row_groups(96, 4096, 1024, True, DEV) == -1


def test_wgmma_a8_row_rule_takes_short_k_layers_between_m_128_and_256(monkeypatch):
    """configs.wgmma_a8_row_declines on the two wide 0.6B layers (K = 1024) between M = 128 and 448,
    against an H100 run with both kernels forced and row scales, after triton_a8's spare rows stopped
    reading one row (M = 160..448 from sweep_a8_b3b2dec.json, M = 256 from the A/B run's new rounds):
    at each point the rule's pick ran within 4% of the faster kernel, where the rule before left
    M = 129..255 to triton_a8, which ran up to 1.25x as long on 1024->4096. (The N = 1024 layers of
    that run predate d190e12: the test above holds them.)"""
    _sm90(monkeypatch)
    monkeypatch.delenv("TERNOP_PDL", raising=False)
    monkeypatch.setattr(configs, "_triton_has_gdc", lambda: True)
    cells = _bench_cells("h100/sweep_a8_b3b2dec.json")
    for r in (1, 2):  # M = 256 (not in the sweep): the mean of the A/B run's two new rounds
        for cell, times in _bench_cells(f"h100/ab_load_rows_new_r{r}_b3b2dec.json").items():
            if cell[0] == 256:
                for impl, us in times.items():
                    cells[cell][impl] = cells[cell].get(impl, 0.0) + us / 2
    triton_row, wgmma_row = "backend:triton_a8[a8 row]", "backend:cuda_wgmma_a8[a8 row]"
    points = {cell: times for cell, times in cells.items() if cell[2] < 4096 and cell[0] > 128 and cell[1] > 1024}
    assert sorted({m for m, _, _ in points}) == [160, 192, 224, 256, 320, 384, 448]
    assert sorted({(n, k) for _, n, k in points}) == [(4096, 1024), (6144, 1024)]
    for (m, n, k), times in points.items():
        triton, wgmma = times[triton_row], times[wgmma_row]
        picked = triton if configs.wgmma_a8_row_declines(m, n, k, DEV) else wgmma
        assert picked <= 1.04 * min(triton, wgmma), (m, n, k, picked, triton, wgmma)
    # The points the change moved, and by how much the old pick (triton_a8) was behind there.
    moved = {cell: times[triton_row] / times[wgmma_row] for cell, times in points.items() if cell[0] <= 256}
    assert max(moved.values()) > 1.2 and min(moved.values()) > 1.0, moved


def test_wgmma_a8_row_rule_takes_4096_to_4096_at_m_96_to_128_since_the_cluster_sums(monkeypatch):
    """At M = 96..128 on 4096->4096 (N * K = 2^24) triton_a8 ran ahead of cuda_wgmma_a8 with row
    scales at M = 128 in every committed run that timed both before d190e12 (H100 and H200), where
    the Hopper kernel's split launches waited on their cluster sums in series. Since, on one H100,
    the Hopper kernel ran 0.92-0.95 of triton_a8's time at M = 96, 112 and 128 (started early after
    the quantization), and the rule gives it those calls."""
    _sm90(monkeypatch)
    monkeypatch.setitem(configs._SM_COUNT_CACHE, 0, 132)
    triton_row, wgmma_row = "backend:triton_a8[a8 row]", "backend:cuda_wgmma_a8[a8 row]"
    ratios = []
    for path in sorted(RESULTS.glob("h*/*.json")):
        try:
            run = json.loads(path.read_text())
            cells, commit = _cells(run), run["commit"]
        except (KeyError, TypeError, ValueError):
            continue  # not a bench_linear run
        times = cells.get((128, 4096, 4096), {})
        if triton_row in times and wgmma_row in times and commit != "01fdd22":
            ratios.append(times[triton_row] / times[wgmma_row])
    assert len(ratios) >= 20 and max(ratios) < 1.0, ratios
    cells = _bench_cells("h100/bench_linear_a8row_4096_01fdd22.json")
    assert sorted(cells) == [(96, 4096, 4096), (112, 4096, 4096), (128, 4096, 4096)]
    for (m, n, k), times in cells.items():
        assert times[wgmma_row] < 0.96 * times[triton_row], (m, times)
        assert configs.wgmma_a8_row_declines(m, n, k, DEV) == "", m


def test_wgmma_a8_row_last_wave_rule_stops_at_k_8192(monkeypatch):
    """From K = 8192 cuda_wgmma_a8 was ahead of triton_a8 with row scales at every M = 257..2047 that
    timed both, short last waves included (14336->4096 at M = 320 and 384, 160 and 192 CTAs, in two
    H100 runs): the last-wave rule keeps to shorter K, where 4096->6144 (an H200, e084e64) still
    has triton_a8 ahead."""
    _sm90(monkeypatch)
    for run in ("h100/sweep_a8_b3b2dec.json", "h100/ab_load_rows_new_r1_b3b2dec.json",
                "h100/ab_load_rows_new_r2_b3b2dec.json", "h200/bench_linear_a8_mid_below_floors_e084e64.json"):
        for (m, n, k), times in _bench_cells(run).items():
            if k >= 8192 and 256 < m < 2048:
                triton, wgmma = times["backend:triton_a8[a8 row]"], times["backend:cuda_wgmma_a8[a8 row]"]
                assert wgmma < triton and configs.wgmma_a8_row_declines(m, n, k, DEV) == "", (run, m, n, k)
    for m in (257, 320, 384, 640):
        assert configs.wgmma_a8_row_declines(m, 4096, 14336, DEV) == "", m
        assert "last wave" in configs.wgmma_a8_row_declines(m, 4096, 4096, DEV), m
    assert "last wave" in configs.wgmma_a8_row_declines(256, 6144, 4096, DEV)

"""TernaryConfig / TernaryLinearMethod / register() without starting an engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.model_executor.layers import linear as L  # noqa: E402

from ternop.vllm_plugin import register  # noqa: E402
from ternop.vllm_plugin.config import TernaryConfig  # noqa: E402
from ternop.vllm_plugin.linear_method import TernaryLinearMethod  # noqa: E402
from ternop.vllm_plugin.sharding import simulated_rank  # noqa: E402


def test_register_is_idempotent_and_makes_ternary_known():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    register()
    register()
    assert get_quantization_config("ternary") is TernaryConfig
    assert QUANTIZATION_METHODS.count("ternary") == 1


@pytest.mark.parametrize(("env", "expected"), [
    ({"TERNOP_FUSE_QUANT": "0"}, "1"),  # a graph cached under the default setting must not be loaded
    ({"TERNOP_FUSE_QUANT": "1"}, "1"),  # nor for a generating model, whose default is the other place
    ({"TERNOP_FUSE_QUANT": "0", "VLLM_DISABLE_COMPILE_CACHE": "0"}, "0"),  # the user's own choice stays
    ({}, None),
])
def test_register_keeps_the_compile_cache_from_mixing_quantization_settings(env, expected):
    code = ("import os; from ternop.vllm_plugin import register; register(); "
            "from vllm import envs; print(os.environ.get('VLLM_DISABLE_COMPILE_CACHE'), envs.VLLM_DISABLE_COMPILE_CACHE)")
    base = {k: v for k, v in os.environ.items() if k not in ("TERNOP_FUSE_QUANT", "VLLM_DISABLE_COMPILE_CACHE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**base, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == [str(expected), str(expected == "1")]


@pytest.mark.parametrize(("runner", "setting", "in_graph"), [
    ("pooling", "", True), (None, "", True),  # embedding models, and TernaryLinear outside vLLM's construction
    ("generate", "", False), ("draft", "", False),  # decode: ternop quantizes inside the op
    ("generate", "1", True), ("pooling", "0", False), ("pooling", "1", True), ("generate", "0", False),
])
def test_where_int8_layers_quantize_follows_the_runner_unless_set(runner, setting, in_graph):
    from ternop.vllm_plugin.linear_method import quant_in_graph

    assert quant_in_graph(runner, setting) is in_graph


def test_import_ternop_does_not_import_vllm():
    code = "import sys, ternop, ternop.checkpoint, ternop.cli.validate; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_config_defaults_and_errors():
    cfg = TernaryConfig.from_config({"quant_method": "ternary"})
    assert (cfg.format_version, cfg.block_size, cfg.modules_to_not_convert) == (1, 128, [])
    assert cfg.get_name() == "ternary"
    assert set(cfg.get_supported_act_dtypes()) == {torch.float16, torch.bfloat16, torch.float32}
    with pytest.raises(ValueError, match="format_version 2"):
        TernaryConfig.from_config({"quant_method": "ternary", "format_version": 2})
    with pytest.raises(ValueError, match="block_size 64"):
        TernaryConfig.from_config({"quant_method": "ternary", "block_size": 64})
    assert cfg.activation_bits == 16
    assert TernaryConfig.from_config({"quant_method": "ternary", "activation_bits": 8}).activation_bits == 8
    for bits in (4, 8.0, "8", True):
        with pytest.raises(ValueError, match=f"quantization_config: activation_bits {bits!r} is not supported"):
            TernaryConfig.from_config({"quant_method": "ternary", "activation_bits": bits})


def test_skip_list_matches_fused_and_prefixed_names():
    cfg = TernaryConfig(modules_to_not_convert=["encoder.layer.0.attention.self.query",
                                                "encoder.layer.0.attention.self.key",
                                                "encoder.layer.0.attention.self.value", "pooler.dense"])  # fmt: skip
    cfg.packed_modules_mapping = {"qkv_proj": ["query", "key", "value"]}
    assert cfg.is_skipped("model.encoder.layer.0.attention.self.qkv_proj")
    assert not cfg.is_skipped("model.encoder.layer.1.attention.self.qkv_proj")
    # vLLM 0.32's BERT names the fused layer under attention.output; its parts are still attention.self's.
    assert cfg.is_skipped("model.encoder.layer.0.attention.output.qkv_proj")
    assert not cfg.is_skipped("model.encoder.layer.1.attention.output.qkv_proj")
    assert cfg.is_skipped("pooler.dense")
    assert not cfg.is_skipped("model.encoder.layer.0.output.dense")
    partial = TernaryConfig(modules_to_not_convert=["layers.0.self_attn.q_proj"])
    partial.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj.*all be ternary or all dense"):
        partial.is_skipped("model.layers.0.self_attn.qkv_proj")


def test_skip_list_mapper_keeps_part_names_in_either_vllm():
    """The skip list takes the mapper's renames only, whichever method this vLLM names them with:
    ``get_rename_mapper`` (0.32) or ``get_unstacked_mapper`` (0.26); fused names never replace part names."""
    from vllm.model_executor.models.utils import WeightsMapper

    from ternop.vllm_plugin._compat import rename_mapper

    whole = WeightsMapper(orig_to_new_prefix={"layers.": "model.layers."},
                          orig_to_new_stacked={".q_proj": (".qkv_proj", "q")})  # fmt: skip
    assert rename_mapper(whole).apply_list(["layers.0.self_attn.q_proj"]) == ["model.layers.0.self_attn.q_proj"]

    class Older:  # only the 0.26 name
        def get_unstacked_mapper(self):
            return "renames"

    class Newer:  # only the 0.32 name
        def get_rename_mapper(self):
            return "renames"

    assert rename_mapper(Older()) == rename_mapper(Newer()) == "renames"
    plain = object()
    assert rename_mapper(plain) is plain


def test_get_quant_method_per_layer_kind():
    cfg = TernaryConfig(modules_to_not_convert=["layers.0.mlp.down_proj"])
    with simulated_rank(0, 1):
        kept = L.RowParallelLinear(256, 128, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.down_proj")
        tern = L.RowParallelLinear(256, 128, bias=True, quant_config=cfg, prefix="model.layers.1.mlp.down_proj")
    assert isinstance(kept.quant_method, L.UnquantizedLinearMethod)
    assert isinstance(tern.quant_method, TernaryLinearMethod)
    assert tern.weight_packed.shape == (128, 64) and tern.weight_packed.dtype == torch.uint8
    assert tern.weight_scale.shape == (128, 2) and tern.weight_scale.dtype == torch.float16
    assert cfg.get_quant_method(torch.nn.Embedding(64, 128), "model.embed_tokens") is None
    assert cfg.get_quant_method(torch.nn.LayerNorm(128), "model.layers.0.input_layernorm") is None


def test_create_weights_rejects_k_per_rank_not_multiple_of_128():
    cfg = TernaryConfig()
    with simulated_rank(1, 2), pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.o_proj.*K=384 split 2 ways gives 192"):
        L.RowParallelLinear(384, 256, bias=False, quant_config=cfg, prefix="model.layers.3.self_attn.o_proj")


def _loaded_column(params_dtype: torch.dtype, bias: bool = True, activation_bits: int = 16, tied: bool = False):
    from ternop.quantize import quantize_weight

    cfg = TernaryConfig(activation_bits=activation_bits)
    with simulated_rank(0, 1):
        layer = L.ColumnParallelLinear(256, 384, bias=bias, quant_config=cfg, prefix="layers.0.fc",
                                       params_dtype=params_dtype, return_bias=False)  # fmt: skip
    packed, scale = quantize_weight(torch.randn(384, 256), "optimal")
    if tied:  # every block of a row with the row's first scale
        scale = scale[:, :1].expand(-1, scale.shape[1]).contiguous()
    layer.weight_packed.weight_loader(layer.weight_packed, packed)
    layer.weight_scale.weight_loader(layer.weight_scale, scale)
    if bias:
        layer.bias.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    return layer, packed, scale


def test_apply_matches_dense_linear_without_casting_the_bias_per_call():
    from torch.utils._python_dispatch import TorchDispatchMode

    from ternop.format import dequantize
    from tests.reference import assert_within_2x_of_dense

    layer, packed, scale = _loaded_column(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                Casts.count += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(5, 256, dtype=torch.bfloat16)
    with Casts():
        y = layer(x)
    assert Casts.count == 0 and y.dtype == torch.bfloat16
    assert_within_2x_of_dense(y, x, packed, scale, layer.bias)


def test_reload_after_load_keeps_vllm_parameters_and_loaders():
    """process_weights_after_loading keeps vLLM's parameter classes, so loading again works."""
    from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

    from ternop.format import dequantize
    from ternop.quantize import quantize_weight

    layer, _, _ = _loaded_column(torch.float32, bias=False)
    assert isinstance(layer.weight_packed, PackedvLLMParameter)
    assert isinstance(layer.weight_scale, GroupQuantScaleParameter)
    packed, scale = quantize_weight(torch.randn(384, 256), "absmean")
    layer.weight_packed.weight_loader(layer.weight_packed, packed)
    layer.weight_scale.weight_loader(layer.weight_scale, scale)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ dequantize(packed, scale).T, rtol=1e-5, atol=1e-5)


def test_apply_runs_the_checkpoints_activation_bits():
    from tests.reference import linear_a8_fp64

    layer, packed, scale = _loaded_column(torch.float32, activation_bits=8)
    assert layer.ternop_activation_bits == 8
    x = torch.randn(5, 256) * 4
    want = linear_a8_fp64(x, packed, scale, layer.bias)
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_a8_rows_with_one_scale_run_as_row_scales_and_still_reload():
    """Tied scales under int8 activations run the row form (int32 over all of K); the loaded
    parameter keeps its [N, K/128] shape, so that loading again still fits it."""
    from tests.reference import linear_a8_row_scales_np

    layer, packed, scale = _loaded_column(torch.float32, activation_bits=8, tied=True)
    assert layer.ternop_row_scaled and tuple(layer.ternop_row_scale.shape) == (384, 1)
    assert tuple(layer.weight_scale.shape) == (384, 2)
    x = torch.randn(5, 256) * 4
    want = torch.from_numpy(linear_a8_row_scales_np(x, packed, scale[:, :1], layer.bias))
    assert torch.equal(layer(x), want)
    # Untied scales (a reload of other weights) go back to the block form.
    layer.weight_scale.weight_loader(layer.weight_scale, scale * torch.tensor([1.0, 0.5], dtype=scale.dtype))
    layer.quant_method.process_weights_after_loading(layer)
    assert not layer.ternop_row_scaled
    # 16-bit activations never need the row form.
    layer16, _, _ = _loaded_column(torch.float32, activation_bits=16, tied=True)
    assert not layer16.ternop_row_scaled


def test_building_a_layer_hands_the_engines_largest_captured_batch_to_the_dispatch(monkeypatch):
    """While vLLM builds a model, creating a ternary layer tells ternop's CUDA dispatch the largest batch the
    engine captures in a CUDA graph (above it, calls run eagerly); outside vLLM's construction nothing changes."""
    from types import SimpleNamespace

    import vllm.config

    from ternop.cuda import configs
    from ternop.vllm_plugin import linear_method

    monkeypatch.delenv("TERNOP_GRAPH_MAX_M", raising=False)
    monkeypatch.setattr(configs, "_engine_graph_max_m", None)
    engine = SimpleNamespace(compilation_config=SimpleNamespace(max_cudagraph_capture_size=128))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: engine)
    with simulated_rank(0, 1):
        layer = L.ReplicatedLinear(256, 64, bias=False, quant_config=TernaryConfig(), prefix="m.proj")
    assert isinstance(layer.quant_method, TernaryLinearMethod)
    assert configs.graph_max_m() == 128
    engine.compilation_config.max_cudagraph_capture_size = 0  # enforce_eager: no graphs at all
    linear_method._note_graph_max_m()
    assert configs.graph_max_m() == 0
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: None)
    linear_method._note_graph_max_m()
    assert configs.graph_max_m() == 0
    configs.set_graph_max_m(None)


def test_loading_a_layer_warms_its_kernels_with_and_without_its_bias(monkeypatch):
    """After loading, each layer is warmed up to the engine's max_num_batched_tokens with the
    scales its calls take (the row scale of tied int8 rows), with its bias and without it (the
    other ranks of a row-parallel layer leave it out); TERNOP_WARMUP=0 skips it."""
    from types import SimpleNamespace

    import vllm.config

    from ternop import warmup

    calls = []
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **kw: calls.append((a, kw)) or [])
    engine = SimpleNamespace(compilation_config=SimpleNamespace(max_cudagraph_capture_size=512),
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=3000))  # fmt: skip
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: engine)
    monkeypatch.delenv(warmup.ENV_WARMUP, raising=False)
    layer, _, _ = _loaded_column(torch.bfloat16, activation_bits=8, tied=True)
    assert [a[2] is None for a, _ in calls] == [True, False]
    for (packed, scale, _), kw in calls:
        assert packed.data_ptr() == layer.weight_packed.data_ptr() and scale is layer.ternop_row_scale
        assert kw == {"activation_bits": 8, "layout": layer.ternop_layout, "dtype": torch.bfloat16, "max_m": 3000}
    assert calls[1][0][2].data_ptr() == layer.bias.data_ptr()
    calls.clear()
    _loaded_column(torch.float32, bias=False)
    assert len(calls) == 1 and calls[0][0][1].shape == (384, 2) and calls[0][1]["max_m"] == 3000
    calls.clear()
    monkeypatch.setenv(warmup.ENV_WARMUP, "0")
    _loaded_column(torch.float32)
    assert calls == []
    from ternop.cuda import configs

    configs.set_graph_max_m(None)


def test_a_warmed_layer_is_reported_in_vllms_log(monkeypatch):
    """The first layer of each kind reports its warm-up through a logger under "vllm" (the only
    loggers vLLM gives a handler), naming the layer and how many kernel variants ran; a layer
    whose kind was warmed before (nothing ran) logs nothing."""
    import logging
    from types import SimpleNamespace

    import vllm.config

    from ternop import warmup
    from ternop.vllm_plugin import linear_method

    assert linear_method.logger.name.startswith("vllm.")
    ran = [[(1, "a", 0), (17, "b", 0)], []]
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **kw: ran.pop(0) if ran else [])
    engine = SimpleNamespace(compilation_config=SimpleNamespace(max_cudagraph_capture_size=512),
                             scheduler_config=SimpleNamespace(max_num_batched_tokens=3000))  # fmt: skip
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: engine)
    monkeypatch.delenv(warmup.ENV_WARMUP, raising=False)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    linear_method.logger.addHandler(handler)
    level = linear_method.logger.level
    linear_method.logger.setLevel(logging.INFO)  # as in an engine, where vLLM configures its loggers
    try:
        _loaded_column(torch.bfloat16)  # with its bias: two calls, 2 + 0 variants
        _loaded_column(torch.bfloat16)  # its kind is warm: 0 variants
    finally:
        linear_method.logger.removeHandler(handler)
        linear_method.logger.setLevel(level)
        from ternop.cuda import configs

        configs.set_graph_max_m(None)
    lines = [r.getMessage() for r in records if "warmed" in r.getMessage()]
    assert len(lines) == 1 and "2 kernel variants" in lines[0] and "M <= 3000" in lines[0], lines

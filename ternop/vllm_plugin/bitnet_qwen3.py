"""Qwen3 with BitNet's per-projection RMSNorm, in vLLM: the BitNet-style embedding (and causal) model.

transformers builds this from a Qwen3 checkpoint whose ``quantization_config`` is BitNet's with
``use_rms_norm: true``: every linear layer becomes ``AutoBitLinear`` with its own RMSNorm
(``<prefix>.rms_norm.weight``) applied to its input before the int8 activation rounding.
``ternop convert`` keeps those norms, writes their eps as ``ternop_projection_norm_eps`` and names
the architecture ``BitNetQwen3Model`` (from ``Qwen3Model``) or ``BitNetQwen3ForCausalLM``.

Because q, k and v (and gate and up) each normalize their input with their own weight, they are
separate column-parallel layers here, not vLLM's fused ``qkv_proj`` / ``gate_up_proj``; the norm
sits on the layer as ``<layer>.rms_norm`` so checkpoint names load unchanged. With int8
activations on one rank each norm hands int8 rows to its layer (``ternop::rms_norm_quant``). The norms of
``o_proj`` and ``down_proj`` see a tensor-parallel slice of their input: they are
:class:`ternop.vllm_plugin.bitnet.ShardedRMSNorm`. The rest is vLLM's Qwen3 (q/k norms per head,
rotary, attention). ``BitNetQwen3Model`` pools the last token and normalizes it (Qwen3-Embedding's
pooling), through vLLM's ``as_embedding_model``.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.adapters import as_embedding_model
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3Attention, Qwen3Model
from vllm.model_executor.models.utils import WeightsMapper, maybe_prefix

from ternop.vllm_plugin._compat import weights_loader
from ternop.vllm_plugin.bitnet import PreNormDecoderLayer, ShardedRMSNorm, check_ternary, norm_quantizes

PROJECTION_NORM_KEY = "ternop_projection_norm_eps"


def _normed(layer: nn.Module, size: int, eps: float, sharded: bool) -> nn.Module:
    layer.rms_norm = ShardedRMSNorm(size, eps, sharded=sharded)
    layer.quantize_in_norm = norm_quantizes(layer.rms_norm, layer)
    return layer


def _apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out, _ = layer(layer.rms_norm.quantized(x) if layer.quantize_in_norm else layer.rms_norm(x))
    return out


class ProjectionNormAttention(Qwen3Attention):
    """Qwen3 attention whose q, k, v and o projections each normalize their own input."""

    def __init__(self, *, config, eps: float, quant_config, prefix: str, **kwargs):
        super().__init__(quant_config=quant_config, prefix=prefix, **kwargs)
        tp = get_tensor_model_parallel_world_size()
        if self.total_num_kv_heads % tp:
            raise ValueError(f"{prefix}: {self.total_num_kv_heads} KV heads cannot split across {tp} ranks "
                             "(separate k/v projections are not replicated)")  # fmt: skip
        del self.qkv_proj  # q, k and v normalize their input each with its own weight: three layers
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        for name, heads in (("q_proj", self.total_num_heads), ("k_proj", self.total_num_kv_heads),
                            ("v_proj", self.total_num_kv_heads)):  # fmt: skip
            layer = ColumnParallelLinear(hidden, heads * self.head_dim, bias=bias, quant_config=quant_config,
                                         prefix=f"{prefix}.{name}")  # fmt: skip
            setattr(self, name, _normed(layer, hidden, eps, sharded=False))
        _normed(self.o_proj, self.total_num_heads * self.head_dim, eps, sharded=True)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = (_apply(p, hidden_states) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = self.q_norm(q.view(*q.shape[:-1], -1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.view(*k.shape[:-1], -1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return _apply(self.o_proj, self.attn(q, k, v))


class ProjectionNormMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, each projection normalizing its own input."""

    def __init__(self, config, eps: float, quant_config, prefix: str):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3's MLP uses silu, this config says hidden_act={config.hidden_act!r}")
        hidden, inter = config.hidden_size, config.intermediate_size
        for name in ("gate_proj", "up_proj"):
            layer = ColumnParallelLinear(hidden, inter, bias=False, quant_config=quant_config, prefix=f"{prefix}.{name}")
            setattr(self, name, _normed(layer, hidden, eps, sharded=False))
        self.down_proj = _normed(RowParallelLinear(inter, hidden, bias=False, quant_config=quant_config,
                                                   prefix=f"{prefix}.down_proj"), inter, eps, sharded=True)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(self.down_proj, nn.functional.silu(_apply(self.gate_proj, x)) * _apply(self.up_proj, x))


class ProjectionNormDecoderLayer(PreNormDecoderLayer):
    """Qwen3's pre-norm block with :class:`ProjectionNormAttention` and :class:`ProjectionNormMLP`."""

    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        eps = float(getattr(config, PROJECTION_NORM_KEY))
        self.self_attn = ProjectionNormAttention(
            config=config,
            eps=eps,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters=config.rope_parameters,
            max_position=config.max_position_embeddings,
            head_dim=getattr(config, "head_dim", None),
            rms_norm_eps=config.rms_norm_eps,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = ProjectionNormMLP(config, eps, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class ProjectionNormQwen3Model(Qwen3Model):
    """vLLM's Qwen3 stack with :class:`ProjectionNormDecoderLayer`; checkpoint names load as they are (no fusing)."""

    hf_to_vllm_mapper = WeightsMapper()

    def __init__(self, *, vllm_config, prefix: str = ""):
        # Qwen3Model's own __init__ names its decoder layer (a class attribute in newer vLLM, fixed in
        # older ones); the Qwen2Model constructor it calls takes the layer type in both (_compat).
        Qwen2Model.__init__(self, vllm_config=vllm_config, prefix=prefix, decoder_layer_type=ProjectionNormDecoderLayer)


class BitNetQwen3ForCausalLM(nn.Module):
    """Qwen3 with per-projection norms on ternary W1.58A8 layers, as a causal LM (module docstring)."""

    packed_modules_mapping: dict[str, list[str]] = {}

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        check_ternary(vllm_config.quant_config, "BitNetQwen3")
        config = vllm_config.model_config.hf_config
        if getattr(config, PROJECTION_NORM_KEY, None) is None:
            raise ValueError(f"BitNetQwen3 needs {PROJECTION_NORM_KEY} in config.json (ternop convert writes it)")
        self.config = config
        self.model = ProjectionNormQwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))  # fmt: skip
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights):
        return weights_loader(self, self.config).load_weights(weights)


BitNetQwen3Model = as_embedding_model(BitNetQwen3ForCausalLM)
BitNetQwen3Model.__name__ = BitNetQwen3Model.__qualname__ = "BitNetQwen3Model"

"""BitNet b1.58 in vLLM: transformers' ``BitNetForCausalLM`` on ternop's ternary layers.

The architecture is Llama's with three changes (transformers' ``modeling_bitnet``):
- an RMSNorm (``attn_sub_norm``) on the attention output, before ``o_proj``;
- a squared-ReLU MLP, ``down_proj(ffn_sub_norm(relu(gate_proj(x))^2 * up_proj(x)))``;
- every linear layer quantizes its input per token to int8 (W1.58A8). Here that is the
  checkpoint's ``activation_bits: 8``, which ``TernaryLinearMethod`` passes to ``ternop::linear``.
  Every layer takes int8 rows that the norm before it made in the same kernel
  (``ternop::rms_norm_quant``, ``ternop::add_rms_norm_quant`` for the pre-norms with their residual
  add; the MLP's squared ReLU and product run in the sub-norm's). The sub-norms do so on one rank.

So the model takes vLLM's Llama attention, decoder stack, LM head and weight loading, and adds
the two sub-norms. Those norms sit on the input of a row-parallel layer, whose features
tensor parallelism splits across ranks: :class:`ShardedRMSNorm` holds this rank's slice of the
norm weight (loaded through its own ``weight_loader``) and all-reduces the sum of squares, so
every rank normalizes by the norm of the whole row. The ternary layers are vLLM's own
``QKVParallelLinear``, ``MergedColumnParallelLinear`` and ``RowParallelLinear``: vLLM's loaders
shard their packed codes and scales.

The model needs a ternary checkpoint (``ternop convert`` writes one from a Hugging Face BitNet
folder); a ``BitNetForCausalLM`` folder with other weights is refused with that advice.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.models.llama import LlamaAttention, LlamaForCausalLM
from vllm.model_executor.utils import set_weight_attrs

from ternop.activations import QuantizedRows
from ternop.vllm_plugin.config import TernaryConfig
from ternop.vllm_plugin.linear_method import FUSE_QUANT, TernaryLinearMethod


class ShardedRMSNorm(nn.Module):
    """RMSNorm over ``size`` features that tensor parallelism splits evenly across ranks.

    Holds this rank's ``size / tp`` slice of the weight. ``forward`` takes this rank's slice of
    x ``[..., size / tp]`` and computes, like transformers' ``BitNetRMSNorm``,
    ``weight * (x / sqrt(mean(x^2) + eps))`` with the mean over all ``size`` features (fp32).
    With ``sharded=False`` every rank holds all features (the input of a column-parallel layer).
    """

    def __init__(self, size: int, eps: float, sharded: bool = True):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size() if sharded else 1
        self.tp_rank = get_tensor_model_parallel_rank() if sharded else 0
        if size % self.tp_size:
            raise ValueError(f"a sub-norm of {size} features cannot split across {self.tp_size} ranks")
        self.size, self.eps = size, eps
        self.weight = nn.Parameter(torch.ones(size // self.tp_size))
        set_weight_attrs(self.weight, {"weight_loader": self.load_weight})

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        part = param.shape[0]
        if loaded.shape != (self.size,):
            raise ValueError(f"sub-norm weight must be [{self.size}], got {list(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.tp_rank * part, part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        sum_sq = xf.pow(2).sum(dim=-1, keepdim=True)
        if self.tp_size > 1:
            sum_sq = tensor_model_parallel_all_reduce(sum_sq)
        xf = xf * torch.rsqrt(sum_sq / self.size + self.eps)
        return self.weight * xf.to(x.dtype)

    def quantized(self, x: torch.Tensor, act: str = "none") -> QuantizedRows:
        """``quantize_rows(forward(h))`` in one kernel (``ternop::rms_norm_quant``), h = x or, with
        ``act="relu2_glu"``, ``relu(x[..., :D])^2 * x[..., D:]``. One rank only: the op sums the
        squares of the row it holds."""
        q, scale = torch.ops.ternop.rms_norm_quant(x, self.weight, self.eps, act)
        return QuantizedRows(q, scale, x.dtype)


class QuantizingRMSNorm(nn.Module):
    """A block's pre-norm whose output only the next ternary layers read, handing them int8 rows.

    vLLM's ``RMSNorm`` calling convention: ``norm(x)`` -> rows, ``norm(x, residual)`` -> (rows,
    x + residual), the rows being :class:`QuantizedRows` (``ternop::rms_norm_quant`` and
    ``ternop::add_rms_norm_quant``). The sum x + residual rounds to x's dtype before the norm, as
    in transformers' BitNet. The norm holds every feature on every rank (its layers are column-parallel).
    """

    quantize_in_norm = True  # counted by ternop.vllm_plugin.linear_methods

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            q, scale = torch.ops.ternop.rms_norm_quant(x, self.weight, self.eps)
            return QuantizedRows(q, scale, x.dtype)
        q, scale, h = torch.ops.ternop.add_rms_norm_quant(x, residual, self.weight, self.eps)
        return QuantizedRows(q, scale, x.dtype), h


def takes_int8_rows(layer: nn.Module) -> bool:
    """Whether ``layer`` takes :class:`QuantizedRows`: a ternary layer with int8 activations, and
    ``TERNOP_FUSE_QUANT`` not 0."""
    method = getattr(layer, "quant_method", None)
    return isinstance(method, TernaryLinearMethod) and method.quant_config.activation_bits == 8 and FUSE_QUANT


def norm_quantizes(norm: ShardedRMSNorm, layer: nn.Module) -> bool:
    """Whether ``layer``, after ``norm``, takes int8 rows from it (``ShardedRMSNorm.quantized``):
    :func:`takes_int8_rows`, on one rank (with more, the row's sum of squares is all-reduced
    between ranks)."""
    return takes_int8_rows(layer) and norm.tp_size == 1


class BitNetAttention(LlamaAttention):
    """Llama attention with ``attn_sub_norm`` between the attention and ``o_proj``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = kwargs["config"]
        self.attn_sub_norm = ShardedRMSNorm(self.total_num_heads * self.head_dim, config.rms_norm_eps)
        self.quantize_in_norm = norm_quantizes(self.attn_sub_norm, self.o_proj)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)
        out, _ = self.o_proj(self.attn_sub_norm.quantized(out) if self.quantize_in_norm else self.attn_sub_norm(out))
        return out


class BitNetMLP(nn.Module):
    """``down_proj(ffn_sub_norm(relu(gate_proj(x))^2 * up_proj(x)))``, gate and up fused as vLLM does."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        if config.hidden_act != "relu2":
            raise ValueError(f"BitNet's MLP uses relu2, this config says hidden_act={config.hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")  # fmt: skip
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")  # fmt: skip
        self.ffn_sub_norm = ShardedRMSNorm(config.intermediate_size, config.rms_norm_eps)
        self.quantize_in_norm = norm_quantizes(self.ffn_sub_norm, self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        if self.quantize_in_norm:
            out, _ = self.down_proj(self.ffn_sub_norm.quantized(gate_up, act="relu2_glu"))
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        out, _ = self.down_proj(self.ffn_sub_norm(torch.square(torch.relu(gate)) * up))
        return out


class PreNormDecoderLayer(nn.Module):
    """Pre-norm block, as Llama's and Qwen3's: x + attn(norm(x)), then + mlp(norm(.)), with vLLM's
    fused residual adds. Subclasses build ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm`` and ``mlp``."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class BitNetDecoderLayer(PreNormDecoderLayer):
    """The BitNet b1.58 block: :class:`PreNormDecoderLayer` with BitNet's attention and MLP."""

    def __init__(self, vllm_config, prefix: str = "", config=None):
        super().__init__()
        config = config or vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = BitNetAttention(
            config=config,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            quant_config=quant_config,
            bias=bias,
            bias_o_proj=bias,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = BitNetMLP(config, quant_config, prefix=f"{prefix}.mlp")
        # The pre-norms feed qkv_proj and gate_up_proj only: with int8 activations they quantize.
        for name, layer in (("input_layernorm", self.self_attn.qkv_proj),
                            ("post_attention_layernorm", self.mlp.gate_up_proj)):  # fmt: skip
            norm = QuantizingRMSNorm if takes_int8_rows(layer) else RMSNorm
            setattr(self, name, norm(config.hidden_size, eps=config.rms_norm_eps))


def check_ternary(quant_config, arch: str) -> None:
    """ValueError unless the checkpoint is a ternop ternary checkpoint."""
    if not isinstance(quant_config, TernaryConfig):
        got = "no quantization" if quant_config is None else f"quantization {quant_config.get_name()!r}"
        raise ValueError(
            f"{arch} in vLLM (ternop's plugin) serves ternary checkpoints; this one has {got}. "
            "Convert the Hugging Face checkpoint first: ternop convert SRC DST"
        )


class BitNetForCausalLM(LlamaForCausalLM):
    """transformers' ``BitNetForCausalLM`` for vLLM (module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_ternary(vllm_config.quant_config, "BitNetForCausalLM")
        if getattr(vllm_config.model_config.hf_config, "ternop_projection_norm_eps", None) is not None:
            raise ValueError("BitNetForCausalLM with an RMSNorm before every projection (use_rms_norm) is not "
                             "supported; ternop serves that variant for Qwen3 (BitNetQwen3Model)")  # fmt: skip
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=BitNetDecoderLayer)

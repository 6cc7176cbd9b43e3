"""``TernaryLinearMethod``: ternary weights inside vLLM's linear layers.

Parameters (per tensor-parallel rank, K = input_size_per_partition, N = sum(output_partition_sizes)):
    weight_packed  uint8   [N, K/4]    PackedvLLMParameter, packed along the input dim, factor 4
    weight_scale   float16 [N, K/128]  GroupQuantScaleParameter
Because both are vLLM parameter classes, vLLM's own weight_loader_v2 slices them for column,
row, fused QKV and merged gate/up layers: rows along the output dim, and along K for row-parallel
layers (K/tp must be a multiple of 128 so that byte and block boundaries fall on rank boundaries).

After loading, the codes are repacked once, in place, into the layout the device's kernels
read fastest (``ternop.layouts.preferred_layout``: "a16" or "a8" on CUDA, format v1 on CPU);
a weight reload loads v1 bytes again and is repacked again. With int8 activations, a layer
whose rows each share one scale also keeps that scale as ``ternop_row_scale`` [N, 1], the
form the W2A8 kernels sum over all of K (``ternop.activations``).

With int8 activations, x is quantized per token in one of two places (:func:`quant_in_graph`):

- **in the compiled graph**, the default of pooling (embedding) models: ``apply`` quantizes x
  with the plain torch ops of ``ternop.activations.quantize_rows`` and calls
  ``ternop::linear_q8`` on the int8 rows, and Inductor fuses the quantization into the RMSNorm
  or activation that produces x, instead of a separate pass over x. Given the same x, the
  result is the same bits either way; but in the fused kernel Inductor computes that x itself,
  and its rounding of a norm in bf16 can differ from the unfused graph's in the last bit (on
  the CPU about 3% of the int8 values moved by one step), as compiled norms already differ
  from eager ones.
- **inside ``ternop::linear``**, the default of generating models: at M <= 2 the CUDA kernel
  quantizes x itself, in the same launch. At decode batch sizes Inductor's fused norm and
  quantization is a one-program reduction per row, slower than the norm alone plus ternop's
  quantization (docs/VLLM_SPEED.md: a Qwen3-8B-shaped decode step on the H200 measured 2.52-2.55
  ms at batch 1 this way, 2.79 ms with the quantization in the graph).

``TERNOP_FUSE_QUANT=1`` (in the graph) or ``0`` (inside the op) overrides the default.

``apply`` also takes :class:`ternop.activations.QuantizedRows`: int8 rows that the norm before
the layer already made (``ternop::rms_norm_quant``, BitNet's norms), passed to
``ternop::linear_q8`` as they are. ``TERNOP_FUSE_QUANT=0`` turns that off as well.
"""

from __future__ import annotations

import os
import time

import torch

import ternop  # noqa: F401  (registers torch.ops.ternop.linear)
from ternop import warmup
from ternop.activations import QuantizedRows, quantize_rows, row_scales
from ternop.format import BLOCK_SIZE, CODES_PER_BYTE, PACKED_DTYPE, SCALE_DTYPE, FormatError, validate
from ternop.layouts import preferred_layout, repack
from ternop.vllm_plugin._compat import (
    GroupQuantScaleParameter,
    LinearMethodBase,
    PackedvLLMParameter,
    register_weight_loader_v2,
    vllm_logger,
)

_EXPECTED = {"weight_packed": (PACKED_DTYPE, CODES_PER_BYTE), "weight_scale": (SCALE_DTYPE, BLOCK_SIZE)}

# The largest batch (tokens) warmed where the engine's config does not say.
DEFAULT_MAX_M = 8192

# In vLLM's log, beside the engine's own lines (a logger outside "vllm" has no handler there).
logger = vllm_logger("ternop")

# TERNOP_FUSE_QUANT as set (read once, at import; vLLM's workers import the plugin after their
# environment is set): "" (unset) leaves the choice to quant_in_graph.
FUSE_QUANT_SETTING = os.environ.get("TERNOP_FUSE_QUANT", "").strip()
# Whether int8 rows may be made outside ternop::linear at all: in the graph, or by a norm.
FUSE_QUANT = FUSE_QUANT_SETTING != "0"


def quant_in_graph(runner: str | None, setting: str = FUSE_QUANT_SETTING) -> bool:
    """Whether a compiled W2A8 layer of a model built for vLLM's ``runner`` ("generate", "draft",
    "pooling"; None outside vLLM's model construction) quantizes x in the graph (True) or inside
    ``ternop::linear`` (False). ``setting`` is ``TERNOP_FUSE_QUANT``: "0" inside the op, any other
    value in the graph; unset, generating models (decode: a few tokens a step) quantize inside
    the op and all others in the graph."""
    if setting:
        return setting != "0"
    return runner not in ("generate", "draft")


def _runner() -> str | None:
    """The runner of the model vLLM is building, or None outside its model construction."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return getattr(getattr(config, "model_config", None), "runner_type", None)


def _note_graph_max_m() -> None:
    """Tells ternop's CUDA dispatch the largest batch the engine being built captures in a CUDA graph
    (``max_cudagraph_capture_size``; 0 when it captures none): larger batches run eagerly, where
    16-bit and row-scaled int8 layers also weigh host time (``ternop.cuda.configs.set_graph_max_m``)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    size = getattr(getattr(config, "compilation_config", None), "max_cudagraph_capture_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        from ternop.cuda import configs

        configs.set_graph_max_m(size)


def _max_batched_tokens() -> int:
    """The most tokens one step of the engine being built runs (``max_num_batched_tokens``), else
    DEFAULT_MAX_M: the largest M its layers see, up to which they are warmed (``ternop.warmup``)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    value = getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else DEFAULT_MAX_M


def _checked_loader(weight_loader, prefix: str, name: str, input_size: int):
    """Wraps vLLM's loader: the checkpoint tensor's dtype and K extent are checked first, and a
    shape mismatch inside vLLM's slicing is reported with the layer name instead of a bare assert."""
    dtype, per = _EXPECTED[name]

    def load(param, loaded_weight: torch.Tensor, *args, **kwargs):
        shard = f" (shard {args[0] if args else kwargs.get('loaded_shard_id')})" if args or kwargs else ""
        where = f"{prefix}.{name}{shard}"
        if loaded_weight.dtype != dtype:
            raise FormatError(f"{where}: checkpoint tensor must be {dtype}, got {loaded_weight.dtype}")
        if loaded_weight.dim() != 2 or loaded_weight.shape[1] * per != input_size:
            raise FormatError(
                f"{where}: checkpoint tensor must be 2-D [N, K/{per}] with K={input_size}, "
                f"i.e. [N, {input_size // per}], got {list(loaded_weight.shape)}"
            )
        try:
            return weight_loader(param, loaded_weight, *args, **kwargs)
        except (AssertionError, RuntimeError) as e:
            raise FormatError(
                f"{where}: checkpoint tensor of shape {list(loaded_weight.shape)} does not fit the layer's "
                f"parameter {list(param.shape)} ({type(e).__name__}: {e})"
            ) from e

    return load


@register_weight_loader_v2
class TernaryLinearMethod(LinearMethodBase):
    """Creates the packed weight and scales, validates them after loading, runs ``ternop::linear``."""

    def __init__(self, quant_config, prefix: str = ""):
        self.quant_config = quant_config
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        prefix = self.prefix or getattr(layer, "prefix", "") or type(layer).__name__
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if k % BLOCK_SIZE != 0:
            tp = max(1, input_size // k)
            raise ValueError(
                f"{prefix}: ternary layers need K per tensor-parallel rank to be a multiple of {BLOCK_SIZE}; "
                f"K={input_size} split {tp} ways gives {k}. Use a tensor_parallel_size that keeps "
                f"K/tp a multiple of {BLOCK_SIZE}, or keep this layer dense (ternop quantize --skip)"
            )
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight_packed = PackedvLLMParameter(
            data=torch.empty(n, k // CODES_PER_BYTE, dtype=PACKED_DTYPE),
            input_dim=1,
            output_dim=0,
            packed_dim=1,
            packed_factor=CODES_PER_BYTE,
            weight_loader=_checked_loader(weight_loader, prefix, "weight_packed", input_size),
        )
        weight_scale = GroupQuantScaleParameter(
            data=torch.empty(n, k // BLOCK_SIZE, dtype=SCALE_DTYPE),
            input_dim=1,
            output_dim=0,
            weight_loader=_checked_loader(weight_loader, prefix, "weight_scale", input_size),
        )
        layer.register_parameter("weight_packed", weight_packed)
        layer.register_parameter("weight_scale", weight_scale)
        layer.ternop_prefix = prefix
        layer.ternop_act_dtype = params_dtype
        layer.ternop_quant_in_graph = quant_in_graph(_runner())
        layer.ternop_max_m = _max_batched_tokens()
        _note_graph_max_m()

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Checks the loaded codes and scales; casts the bias to the activation dtype once.

        The parameters stay vLLM's own classes with their ``weight_loader``, so a weight
        reload (``LLM.collective_rpc("reload_weights")``, RL weight sync) loads into them again.
        """
        prefix = getattr(layer, "ternop_prefix", self.prefix)
        validate(layer.weight_packed.data, layer.weight_scale.data, name=prefix)
        bits = self.quant_config.activation_bits
        device = layer.weight_packed.device
        if bits == 8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(
                f"{prefix}: activation_bits=8 runs on int8 tensor cores, which need sm_80 or newer; "
                f"this GPU is sm_{major}{minor}. Serve a checkpoint with activation_bits 16 instead."
            )
        layout = preferred_layout(bits, device)
        if layout != "v1":
            layer.weight_packed.data = repack(layer.weight_packed.data, layout)
        # With int8 activations, rows whose blocks share one scale (BitNet-style checkpoints,
        # `ternop quantize --scales row`) run with a scale per row: int32 sums over all of K and
        # one scaling per output (ternop/activations.py). weight_scale keeps its shape, so that a
        # reload still fits it.
        tied = row_scales(layer.weight_scale.data) if bits == 8 else None
        layer.ternop_row_scaled = tied is not None
        if tied is not None:
            layer.register_buffer("ternop_row_scale", tied, persistent=False)
        layer.ternop_layout = layout
        layer.ternop_activation_bits = bits
        bias = getattr(layer, "bias", None)
        dtype = getattr(layer, "ternop_act_dtype", None)
        if isinstance(bias, torch.Tensor) and dtype is not None and bias.dtype != dtype:
            bias.data = bias.data.to(dtype)
        if warmup.enabled():  # (on CUDA; elsewhere nothing is compiled and warm_up returns at once)
            # Compile the kernels of every batch size this layer can see now, not on a request. A layer
            # with a bias is warmed without it too: vLLM leaves it out on the other ranks of a
            # row-parallel layer and where the model adds it itself (skip_bias_add).
            biases = [None] + ([bias.data] if isinstance(bias, torch.Tensor) else [])
            max_m = getattr(layer, "ternop_max_m", DEFAULT_MAX_M)
            start = time.perf_counter()
            ran = 0
            for b in biases:
                ran += len(warmup.warm_up(layer.weight_packed.data, tied if tied is not None else layer.weight_scale.data,
                                          b, activation_bits=bits, layout=layout, dtype=dtype or torch.bfloat16,
                                          max_m=max_m))  # fmt: skip
            if ran:  # the first layer of its kind in this process
                n, k = layer.weight_packed.shape[0], layer.weight_packed.shape[1] * CODES_PER_BYTE
                logger.info("ternop: warmed %s (%d x %d, activation_bits=%d, layout %s): %d kernel variants "
                            "for M <= %d in %.1f s", prefix, n, k, bits, layout, ran, max_m,
                            time.perf_counter() - start)  # fmt: skip

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # The bias is already in the activation dtype (process_weights_after_loading): no per-call cast.
        scale = layer.ternop_row_scale if layer.ternop_row_scaled else layer.weight_scale
        if isinstance(x, QuantizedRows):  # quantized by the norm before this layer (ternop::rms_norm_quant)
            if layer.ternop_activation_bits != 8:
                name = getattr(layer, "ternop_prefix", self.prefix)
                raise ValueError(f"{name}: got int8 rows, but its checkpoint has "
                                 f"activation_bits={layer.ternop_activation_bits}")  # fmt: skip
            rows = x
        elif layer.ternop_activation_bits == 8 and layer.ternop_quant_in_graph and torch.compiler.is_compiling():
            rows = QuantizedRows(*quantize_rows(x), x.dtype)
        else:
            return torch.ops.ternop.linear(x, layer.weight_packed, scale, bias, layer.ternop_activation_bits,
                                           layer.ternop_layout)  # fmt: skip
        return torch.ops.ternop.linear_q8(rows.q, rows.scale, layer.weight_packed, scale, bias, rows.out_dtype,
                                          layer.ternop_layout)  # fmt: skip

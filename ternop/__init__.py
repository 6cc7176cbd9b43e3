"""ternop: ternary-weight linear layers for PyTorch and vLLM.

Importing ternop registers ``torch.ops.ternop.linear`` (and ``linear_q8``, the same product
from already quantized int8 activations; ``rms_norm_quant`` and ``add_rms_norm_quant``, RMSNorms
that make those int8 rows) and the CPU backend. It never
imports vllm or triton and never initialises CUDA; the CUDA backends load on the first
CUDA call.
"""

from ternop import cpu as _cpu  # noqa: F401  (registers the CPU backend)
from ternop.format import BLOCK_SIZE, FORMAT_VERSION, FormatError, dequantize, pack_codes, unpack_codes
from ternop.modules import QuantizeReport, TernaryLinear, quantize_module
from ternop.norm_quant import add_rms_norm_quant, rms_norm_quant
from ternop.ops import linear, linear_q8, ternary_linear
from ternop.quantize import quantize_weight

__version__ = "0.1.0"

__all__ = [
    "BLOCK_SIZE",
    "FORMAT_VERSION",
    "FormatError",
    "QuantizeReport",
    "TernaryLinear",
    "add_rms_norm_quant",
    "dequantize",
    "linear",
    "linear_q8",
    "pack_codes",
    "quantize_module",
    "quantize_weight",
    "rms_norm_quant",
    "ternary_linear",
    "unpack_codes",
]

"""Format-v1 checkpoint I/O: read and write the Hugging Face folders that hold ternary layers.

Pure reading and writing: nothing here quantizes, imports transformers or runs the op.
"""

from ternop.checkpoint.reader import (
    PACKED_SUFFIX,
    QUANT_METHOD,
    SCALE_SUFFIX,
    CheckpointError,
    dequantized_state_dict,
    iter_tensors,
    load_config,
    load_ternary_layers,
    model_folder,
    read_quant_config,
    safetensors_files,
    tensor_index,
    ternary_prefixes,
)
from ternop.checkpoint.writer import (
    atomic_folder,
    check_destination,
    check_not_quantized,
    quant_config,
    stream_checkpoint,
    write_checkpoint,
)

__all__ = [
    "PACKED_SUFFIX",
    "QUANT_METHOD",
    "SCALE_SUFFIX",
    "CheckpointError",
    "atomic_folder",
    "check_destination",
    "check_not_quantized",
    "dequantized_state_dict",
    "iter_tensors",
    "load_config",
    "load_ternary_layers",
    "model_folder",
    "quant_config",
    "read_quant_config",
    "safetensors_files",
    "stream_checkpoint",
    "tensor_index",
    "ternary_prefixes",
    "write_checkpoint",
]

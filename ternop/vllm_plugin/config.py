"""``TernaryConfig``: vLLM's view of a checkpoint's ``quantization_config`` (format v1)."""

from __future__ import annotations

from typing import Any

import torch

from ternop.format import BLOCK_SIZE, DEFAULT_ACTIVATION_BITS, FORMAT_VERSION, check_activation_bits
from ternop.vllm_plugin._compat import (LinearBase, QuantizationConfig, UnquantizedLinearMethod, part_heads,
                                        rename_mapper)  # fmt: skip


class TernaryConfig(QuantizationConfig):
    """``{"quant_method": "ternary", "format_version": 1, "block_size": 128, "modules_to_not_convert": [...],
    "activation_bits": 16}``.

    Missing keys take these defaults; another format_version or block_size is an error, and so
    is an ``activation_bits`` other than 16 (x as given) or 8 (x quantized per token to int8;
    ternop/activations.py is the spec).
    ``modules_to_not_convert`` holds Hugging Face module names (as in the checkpoint); the
    linear layers they name are served by vLLM's unquantized method.
    """

    def __init__(
        self,
        format_version: int = FORMAT_VERSION,
        block_size: int = BLOCK_SIZE,
        modules_to_not_convert: list[str] | None = None,
        activation_bits: int = DEFAULT_ACTIVATION_BITS,
    ):
        super().__init__()
        activation_bits = check_activation_bits(activation_bits, "ternary quantization_config")
        if int(format_version) != FORMAT_VERSION:
            raise ValueError(
                f"ternary quantization_config: format_version {format_version} is not supported "
                f"(this ternop reads format_version {FORMAT_VERSION})"
            )
        if int(block_size) != BLOCK_SIZE:
            raise ValueError(
                f"ternary quantization_config: block_size {block_size} is not supported (format v1 uses {BLOCK_SIZE})"
            )
        self.format_version = FORMAT_VERSION
        self.block_size = BLOCK_SIZE
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.activation_bits = activation_bits
        self._vllm_names: list[str] = []

    def __repr__(self) -> str:
        return (
            f"TernaryConfig(format_version={self.format_version}, block_size={self.block_size}, "
            f"activation_bits={self.activation_bits}, modules_to_not_convert={len(self.modules_to_not_convert)} entries)"
        )

    @classmethod
    def get_name(cls) -> str:
        return "ternary"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TernaryConfig":
        method = config.get("quant_method", "ternary")
        if method != "ternary":
            raise ValueError(f"TernaryConfig got quant_method {method!r}, expected 'ternary'")
        return cls(
            format_version=cls.get_from_keys_or(config, ["format_version"], FORMAT_VERSION),
            block_size=cls.get_from_keys_or(config, ["block_size"], BLOCK_SIZE),
            modules_to_not_convert=cls.get_from_keys_or(config, ["modules_to_not_convert"], None),
            activation_bits=cls.get_from_keys_or(config, ["activation_bits"], DEFAULT_ACTIVATION_BITS),
        )

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """Also keeps the skip list under the model's vLLM names (e.g. an added ``model.`` prefix)."""
        self._vllm_names = rename_mapper(hf_to_vllm_mapper).apply_list(list(self.modules_to_not_convert))

    def is_skipped(self, prefix: str) -> bool:
        """Whether the vLLM linear layer ``prefix`` stays unquantized.

        A fused layer (``...qkv_proj``) is matched through its parts from
        ``packed_modules_mapping`` (``q_proj``/``k_proj``/``v_proj``, or BERT's
        ``query``/``key``/``value``); its parts must agree. Names match whole dotted
        components at the end, so ``encoder.layer.0.attention.self.query`` matches
        ``model.encoder.layer.0.attention.self.query``.
        """
        names = set(self.modules_to_not_convert) | set(self._vllm_names)
        if not names:
            return False

        def listed(p: str) -> bool:
            return any(p == n or p.endswith("." + n) or n.endswith("." + p) for n in names)

        head, _, last = prefix.rpartition(".")
        if listed(prefix):
            return True
        parts = self.packed_modules_mapping.get(last)
        if not parts:
            return False
        heads = part_heads(head, last)
        flags = {part: any(listed(f"{h}.{part}" if h else part) for h in heads) for part in parts}
        if len(set(flags.values())) > 1:
            raise ValueError(
                f"{prefix}: the fused parts {parts} must all be ternary or all dense, but "
                f"modules_to_not_convert lists only {[p for p, f in flags.items() if f]}"
            )
        return all(flags.values())

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        from ternop.vllm_plugin.linear_method import TernaryLinearMethod

        return TernaryLinearMethod(self, prefix)

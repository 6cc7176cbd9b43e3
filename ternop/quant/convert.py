"""``quantize_checkpoint``: an HF model folder -> a format-v1 checkpoint, one tensor at a time.

The 2-D ``.weight`` tensors of linear layers inside the transformer blocks are quantized
(:mod:`ternop.selection`); embeddings, norms, poolers, lm_head and ``skip`` matches are
copied as they are. The methods (:data:`METHODS`) turn one dense weight into (packed, scale):
``optimal`` and ``absmean`` round each 128-block on its own; ``calibrated`` first runs the
model on calibration text (:mod:`ternop.quant.calibrate`) and answers from that.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ternop.checkpoint import CheckpointError, check_destination, check_not_quantized, quant_config, stream_checkpoint
from ternop.checkpoint import tensor_index
from ternop.checkpoint.safetensors_io import element_size
from ternop.format import BLOCK_SIZE, DEFAULT_ACTIVATION_BITS, packed_bytes
from ternop.quant.calibrate import CALIB_TOKENS
from ternop.quantize import quantize_weight
from ternop.selection import DEFAULT_SKIP, QuantizeReport, check_skip_patterns, in_transformer_block, matches_any
from ternop.selection import should_quantize

Quantizer = Callable[[str, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]
"""(checkpoint prefix, dense weight [N, K]) -> (weight_packed uint8 [N, K/4], weight_scale float16 [N, K/128])."""


def rounding_quantizer(method: str, scales: str = "block") -> Quantizer:
    """The rounding ``method`` (``ternop.quantize``) as a Quantizer, with a scale per 128 weights
    (``scales="block"``) or per row (``"row"``)."""
    return lambda name, weight: quantize_weight(weight, method, scales)


def _rounding(method: str) -> Callable[..., Quantizer]:
    def factory(src: Path, calib: str | None, skip: tuple[str, ...], calib_tokens: int = CALIB_TOKENS,
                progress: bool = True) -> Quantizer:  # fmt: skip
        return rounding_quantizer(method)

    return factory


def calibrated_quantizer(src: Path, calib: str | None, skip: tuple[str, ...], calib_tokens: int = CALIB_TOKENS,
                         progress: bool = True, **kwargs) -> Quantizer:  # fmt: skip
    """The ``calibrated`` method: calibrates the whole model of ``src`` on the text file ``calib`` up front,
    on its first ``calib_tokens`` tokens.

    A layer the calibration did not reach falls back to ``optimal`` rounding (with a note on stderr).
    """
    from ternop.hf import load_model, load_tokenizer, module_to_checkpoint
    from ternop.quant.calibrate import calibrate_model, read_calibration_text, to_packed

    if calib is None:
        raise CheckpointError("--method calibrated needs --calib FILE (text to collect activation statistics)")
    check_calib_tokens(calib_tokens)
    texts = read_calibration_text(calib)  # before the model loads: a bad path fails at once
    model = load_model(src, causal=False)
    results = calibrate_model(model, load_tokenizer(src), texts, skip, max_tokens=calib_tokens, progress=progress,
                              **kwargs)  # fmt: skip
    weights = [n[: -len(".weight")] for n in tensor_index(src) if n.endswith(".weight")]
    names = module_to_checkpoint(model, results, weights)
    table = {names[name]: to_packed(values, scale) for name, (values, scale) in results.items() if name in names}

    def quantizer(prefix: str, weight: torch.Tensor):
        if prefix in table:
            return table[prefix]
        print(f"ternop: {prefix} was not reached by calibration; using optimal rounding", file=sys.stderr)
        return quantize_weight(weight, "optimal")

    return quantizer


def check_calib_tokens(calib_tokens: int) -> None:
    if not isinstance(calib_tokens, int) or calib_tokens < 1:
        raise CheckpointError(f"--calib-tokens must be a positive number of tokens, got {calib_tokens!r}")


METHODS: dict[str, Callable[..., Quantizer]] = {
    "optimal": _rounding("optimal"),
    "absmean": _rounding("absmean"),
    "calibrated": calibrated_quantizer,
}
"""Methods of ``ternop quantize``: name -> factory(src, calib, skip, calib_tokens, progress) -> Quantizer.
Another module may add one."""


@dataclass
class CheckpointReport(QuantizeReport):
    """What quantize_checkpoint did (names, bytes) and where it wrote."""

    dst: str = ""
    method: str = ""
    activation_bits: int = DEFAULT_ACTIVATION_BITS


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the tensor ``name`` is the weight of a linear layer: 2-D ``.weight``, not an embedding table."""
    return name.endswith(".weight") and len(shape) == 2 and "embed" not in name.rsplit(".", 2)[-2].lower()


def plan_quantization(src: str | os.PathLike, skip: Iterable[str] = ()) -> CheckpointReport:
    """Which linear layers of the folder ``src`` become ternary, from the safetensors headers alone.

    Raises CheckpointError for a layer that should be quantized but has K not a multiple of 128,
    and ValueError for a skip pattern that matches no linear layer.
    """
    skip = tuple(skip)
    report = CheckpointReport()
    for name, info in tensor_index(src).items():
        if not is_linear_weight(name, info.shape):
            continue
        prefix, (n, k) = name[: -len(".weight")], info.shape
        if matches_any(prefix, (*DEFAULT_SKIP, *skip)) is None and in_transformer_block(prefix) and k % BLOCK_SIZE:
            raise CheckpointError(
                f"{name} has K={k} (shape {list(info.shape)}), not a multiple of {BLOCK_SIZE}; "
                f"format v1 cannot store it. Leave it dense with --skip {prefix}"
            )
        ok, why = should_quantize(prefix, k, skip)
        if not ok:
            report.skipped[prefix] = why
            continue
        report.quantized.append(prefix)
        report.dense_bytes += n * k * element_size(info.dtype)
        report.ternary_bytes += packed_bytes(n, k)
    check_skip_patterns(skip, [*report.quantized, *report.skipped])
    return report


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    method: str = "optimal",
    skip: Iterable[str] = (),
    progress: bool = True,
    quantizer: Quantizer | None = None,
    *,
    calib: str | None = None,
    calib_tokens: int = CALIB_TOKENS,
    overwrite: bool = False,
    activation_bits: int = DEFAULT_ACTIVATION_BITS,
) -> CheckpointReport:
    """Quantizes the HF folder ``src`` into a v1 checkpoint at ``dst``, tensor by tensor.

    ``quantizer(prefix, weight [N, K]) -> (packed, scale)`` replaces the ``method`` if given.
    ``modules_to_not_convert`` lists the linear layers left dense. ``activation_bits`` is the
    mode the checkpoint runs in: 16 (activations as given) or 8 (int8 per token, W2A8); the
    weights are the same either way. ``calib_tokens``: how many tokens of ``calib`` the
    ``calibrated`` method uses. Every check (activation_bits, source, destination, skip
    patterns, shapes) runs before any model is loaded or byte written.
    """
    quant_config([], activation_bits)  # CheckpointError naming activation_bits
    check_calib_tokens(calib_tokens)
    src_p, skip = Path(src), tuple(skip)
    check_not_quantized(src_p)
    check_destination(src_p, dst, overwrite)
    report = plan_quantization(src_p, skip)
    report.dst, report.method, report.activation_bits = str(dst), method, activation_bits
    if quantizer is None:
        if method not in METHODS:
            raise CheckpointError(f"unknown method {method!r}; choose one of {sorted(METHODS)}")
        quantizer = METHODS[method](src_p, calib, skip, calib_tokens, progress)
    chosen = set(report.quantized)
    stream_checkpoint(src_p, dst, decide=lambda name, shape, dtype: name[: -len(".weight")] in chosen,
                      make_pair=lambda prefix, load: quantizer(prefix, load()),
                      modules_to_not_convert=list(report.skipped), overwrite=overwrite, progress=progress,
                      activation_bits=activation_bits)  # fmt: skip
    return report

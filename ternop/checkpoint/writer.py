"""Format-v1 checkpoints: write them (``ternop quantize``), read them back.

A v1 checkpoint is a Hugging Face model folder in which each quantized linear layer's
``<prefix>.weight`` is replaced by ``<prefix>.weight_packed`` (uint8 [N, K/4]) and
``<prefix>.weight_scale`` (float16 [N, K/128]), and ``config.json`` gains a
``quantization_config`` with ``quant_method: "ternary"`` (see ternop.format / docs/FORMAT.md).

Writing streams: the output header is planned from the input shapes, then each tensor is
read, transformed and written before the next is read, so peak memory is about one tensor.
The output is built in a temporary sibling folder and renamed into place at the end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ternop.checkpoint.safetensors_io import element_size, st_dtype, write_safetensors
from ternop.format import BLOCK_SIZE, CODES_PER_BYTE, FORMAT_VERSION, PACKED_DTYPE, SCALE_DTYPE, check_shapes
from ternop.format import dequantize as _dequantize
from ternop.modules import QuantizeReport
from ternop.quantize import quantize_weight
from ternop.selection import DEFAULT_SKIP, in_transformer_block, matches_any, should_quantize

QUANT_METHOD = "ternary"
PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"

Quantizer = Callable[[str, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


class CheckpointError(ValueError):
    """A model folder cannot be quantized or read; the message says which file or tensor and why."""


# --- methods: name -> factory(src_dir, calib_path, skip) -> quantizer(name, weight) -> (packed, scale) ---


def _rounding(method: str) -> Callable[[Path, str | None, tuple[str, ...]], Quantizer]:
    def factory(src: Path, calib: str | None, skip: tuple[str, ...]) -> Quantizer:
        return lambda name, weight: quantize_weight(weight, method)

    return factory


def _calibrated(src: Path, calib: str | None, skip: tuple[str, ...]) -> Quantizer:
    if calib is None:
        raise CheckpointError("--method calibrated needs --calib FILE (text to collect activation statistics)")
    try:
        module = importlib.import_module("ternop.quant.calibrate")
    except ModuleNotFoundError as e:
        raise CheckpointError(f"--method calibrated is not available in this build ({e})") from e
    return module.make_quantizer(src, calib, skip=skip)


METHODS: dict[str, Callable[[Path, str | None, tuple[str, ...]], Quantizer]] = {
    "optimal": _rounding("optimal"),
    "absmean": _rounding("absmean"),
    "calibrated": _calibrated,
}
"""Quantization methods of ``ternop quantize``. Another module may add an entry."""


# --- reading ---


def _safetensors_files(src: Path) -> list[Path]:
    if not src.is_dir():
        raise CheckpointError(f"model folder {str(src)!r} does not exist or is not a folder")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"no *.safetensors in {str(src)!r}; ternop reads safetensors only "
            "(convert a pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def _load_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def read_quant_config(path: str | os.PathLike) -> dict | None:
    """The checkpoint's ``quantization_config`` with defaults filled in, or None if it has none.

    Raises CheckpointError for a quant_method other than "ternary" or an unsupported
    format_version / block_size.
    """
    qc = _load_config(Path(path)).get("quantization_config")
    if qc is None:
        return None
    if qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{path}: quantization_config.quant_method is {qc.get('quant_method')!r}, not 'ternary'")
    out = {
        "quant_method": QUANT_METHOD,
        "format_version": int(qc.get("format_version", FORMAT_VERSION)),
        "block_size": int(qc.get("block_size", BLOCK_SIZE)),
        "modules_to_not_convert": list(qc.get("modules_to_not_convert") or []),
    }
    if out["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {out['format_version']} is not supported (expected 1)")
    if out["block_size"] != BLOCK_SIZE:
        raise CheckpointError(f"{path}: block_size {out['block_size']} is not supported (format v1 uses 128)")
    return out


def _iter_tensors(src: Path) -> Iterable[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in _safetensors_files(src):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_ternary_layers(path: str | os.PathLike) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """prefix -> (weight_packed uint8 [N, K/4], weight_scale float16 [N, K/128]) for every ternary layer.

    Checks shapes and dtypes (not the codes: see ternop.format.validate).
    """
    packed, scale = {}, {}
    for name, t in _iter_tensors(Path(path)):
        if name.endswith(PACKED_SUFFIX):
            packed[name[: -len(PACKED_SUFFIX)]] = t
        elif name.endswith(SCALE_SUFFIX):
            scale[name[: -len(SCALE_SUFFIX)]] = t
    for prefix in sorted(set(packed) ^ set(scale)):
        have, miss = (PACKED_SUFFIX, SCALE_SUFFIX) if prefix in packed else (SCALE_SUFFIX, PACKED_SUFFIX)
        raise CheckpointError(f"{prefix}: the checkpoint has {prefix}{have} but no {prefix}{miss}")
    out = {}
    for prefix in sorted(packed):
        check_shapes(packed[prefix], scale[prefix], prefix)
        out[prefix] = (packed[prefix], scale[prefix])
    return out


def dequantized_state_dict(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, with each ternary pair replaced by a dense ``<prefix>.weight``.

    The dense weight is ``[N, K]`` in ``dtype`` (fp32 by default); other tensors keep their stored dtype.
    """
    layers = load_ternary_layers(path)
    out = {}
    for name, t in _iter_tensors(Path(path)):
        if name.endswith(PACKED_SUFFIX) or name.endswith(SCALE_SUFFIX):
            continue
        out[name] = t
    for prefix, (packed, scale) in layers.items():
        out[prefix + ".weight"] = _dequantize(packed, scale, dtype)
    return out


# --- writing ---


def _check_not_quantized(src: Path, files: list[Path]) -> None:
    from safetensors import safe_open

    qc = _load_config(src).get("quantization_config")
    if qc is not None:
        raise CheckpointError(
            f"{str(src)!r} is already quantized (config.json has quantization_config with "
            f"quant_method={qc.get('quant_method')!r}); start from the floating-point model"
        )
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(PACKED_SUFFIX):
                    raise CheckpointError(f"{str(src)!r} is already quantized: {file.name} holds {name}")


def _copy_others(src: Path, tmp: Path, quant_config: dict, renamed: Mapping[str, list[str]]) -> None:
    """Copies every non-safetensors file; patches config.json and any safetensors index."""
    for item in src.iterdir():
        dst = tmp / item.name
        if item.is_dir():
            shutil.copytree(item, dst)
        elif item.name == "config.json":
            config = _load_config(src)
            config["quantization_config"] = quant_config
            dst.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        elif item.name.endswith(".safetensors.index.json"):
            index = json.loads(item.read_text())
            weight_map = {}
            for name, file in index.get("weight_map", {}).items():
                for new in renamed.get(name, [name]):
                    weight_map[new] = file
            index["weight_map"] = weight_map
            index.get("metadata", {}).pop("total_size", None)
            dst.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        elif item.suffix != ".safetensors":
            shutil.copy2(item, dst)


def _write(
    src: Path,
    dst: Path,
    decide: Callable[[str, tuple[int, ...], torch.dtype], bool],
    make_pair: Callable[[str, Callable[[], torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
    overrides: Mapping[str, torch.Tensor],
    modules_to_not_convert: Iterable[str],
    overwrite: bool,
    progress: bool,
) -> list[str]:
    """The common writer; returns the quantized prefixes.

    ``decide(name, shape, dtype)`` says whether tensor ``name`` (any ``.weight``) becomes ternary;
    ``make_pair(prefix, load_weight)`` returns its (packed, scale).
    """
    from safetensors import safe_open
    from tqdm import tqdm

    files = _safetensors_files(src)
    if dst.exists() and dst.resolve() == src.resolve():
        raise CheckpointError(f"destination {str(dst)!r} is the source folder; choose another folder")
    if dst.exists() and not overwrite and (not dst.is_dir() or any(dst.iterdir())):
        raise CheckpointError(f"destination {str(dst)!r} exists and is not empty (use --force to replace it)")
    plans, quantized, renamed, seen = [], [], {}, set()
    for file in files:
        plan = []
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                seen.add(name)
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if name.endswith(".weight") and decide(name, shape, st_dtype(sl.get_dtype())):
                    prefix = name[: -len(".weight")]
                    n, k = shape
                    plan.append((prefix + PACKED_SUFFIX, PACKED_DTYPE, (n, k // CODES_PER_BYTE)))
                    plan.append((prefix + SCALE_SUFFIX, SCALE_DTYPE, (n, k // BLOCK_SIZE)))
                    quantized.append(prefix)
                    renamed[name] = [prefix + PACKED_SUFFIX, prefix + SCALE_SUFFIX]
                elif name in overrides:
                    plan.append((name, overrides[name].dtype, tuple(overrides[name].shape)))
                else:
                    plan.append((name, st_dtype(sl.get_dtype()), shape))
            plans.append((file, plan, f.metadata()))
    unknown = sorted(set(overrides) - seen)
    if unknown:
        raise CheckpointError(f"overrides name tensors that are not in the source: {unknown[:5]}")
    quant_config = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "block_size": BLOCK_SIZE,
        "modules_to_not_convert": sorted(set(modules_to_not_convert)),
    }
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        _copy_others(src, tmp, quant_config, renamed)
        bar = tqdm(total=len(quantized), unit="layer", desc="quantize", file=sys.stderr, disable=not progress)
        for file, plan, metadata in plans:
            with safe_open(str(file), framework="pt") as f:
                pending: dict[str, torch.Tensor] = {}

                def produce(out_name: str) -> torch.Tensor:
                    if out_name in pending:
                        return pending.pop(out_name)
                    prefix = out_name[: -len(PACKED_SUFFIX)]
                    if out_name.endswith(PACKED_SUFFIX) and prefix + ".weight" in renamed:
                        bar.set_postfix_str(prefix, refresh=False)
                        packed, scale = make_pair(prefix, lambda: f.get_tensor(prefix + ".weight"))
                        bar.update(1)
                        pending[prefix + SCALE_SUFFIX] = scale
                        return packed
                    if out_name in overrides:
                        return overrides[out_name]
                    return f.get_tensor(out_name)

                write_safetensors(tmp / file.name, plan, produce, metadata)
        bar.close()
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.rename(dst, old / dst.name)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return quantized


def write_checkpoint(
    src_dir: str | os.PathLike,
    dst_dir: str | os.PathLike,
    quantized: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    modules_to_not_convert: Iterable[str],
    overrides: Mapping[str, torch.Tensor] | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> None:
    """Writes a v1 checkpoint at ``dst_dir`` from the HF folder ``src_dir`` and ready-made ternary layers.

    ``quantized`` maps a layer prefix (``encoder.layer.0.attention.self.query``) to its
    (weight_packed uint8 [N, K/4], weight_scale float16 [N, K/128]); its ``<prefix>.weight``
    is replaced. Any other tensor is taken from ``overrides`` if present there, else copied.
    Every non-safetensors file is copied; config.json gains the quantization_config.
    Atomic: ``dst_dir`` appears complete or not at all.
    """
    from safetensors import safe_open

    src, overrides = Path(src_dir), dict(overrides or {})
    files = _safetensors_files(src)
    _check_not_quantized(src, files)
    names = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    missing = sorted(p for p in quantized if p + ".weight" not in names)
    if missing:
        raise CheckpointError(f"quantized layers with no <prefix>.weight in {str(src)!r}: {missing[:5]}")
    for prefix, (packed, scale) in quantized.items():
        check_shapes(packed, scale, prefix)

    def decide(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        prefix = name[: -len(".weight")]
        if prefix not in quantized or len(shape) != 2:
            return False
        n, k = check_shapes(*quantized[prefix], prefix)
        if (n, k) != shape:
            raise CheckpointError(f"{prefix}: ternary layer is [N, K] = {[n, k]}, but {name} is {list(shape)}")
        return True

    _write(src, Path(dst_dir), decide, lambda prefix, _load: quantized[prefix], overrides, modules_to_not_convert,
           overwrite, progress)  # fmt: skip


@dataclass
class CheckpointReport(QuantizeReport):
    """What quantize_checkpoint did (names, bytes) and where it wrote."""

    dst: str = ""
    method: str = ""


def _is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(".weight") and len(shape) == 2 and "embed" not in name.rsplit(".", 2)[-2].lower()


def quantize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    method: str = "optimal",
    skip: Iterable[str] = (),
    progress: bool = True,
    quantizer: Quantizer | None = None,
    *,
    calib: str | None = None,
    overwrite: bool = False,
) -> CheckpointReport:
    """Quantizes the HF folder ``src`` into a v1 checkpoint at ``dst``, tensor by tensor.

    The 2-D ``.weight`` tensors of linear layers inside the transformer blocks are quantized
    (ternop.selection); embeddings, norms, poolers, lm_head and ``skip`` matches are kept and
    listed in ``modules_to_not_convert``. ``quantizer(prefix, weight [N, K]) -> (packed, scale)``
    replaces the ``method`` if given.
    """
    src_p, skip = Path(src), tuple(skip)
    files = _safetensors_files(src_p)
    _check_not_quantized(src_p, files)
    if quantizer is None:
        if method not in METHODS:
            raise CheckpointError(f"unknown method {method!r}; choose one of {sorted(METHODS)}")
        quantizer = METHODS[method](src_p, calib, skip)
    report = CheckpointReport(dst=str(dst), method=method)
    keep: list[str] = []

    def decide(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        prefix = name[: -len(".weight")]
        if not _is_linear_weight(name, shape):
            keep.append(prefix)
            report.skipped[prefix] = "not a linear layer"
            return False
        n, k = shape
        if matches_any(prefix, (*DEFAULT_SKIP, *skip)) is None and in_transformer_block(prefix) and k % BLOCK_SIZE:
            raise CheckpointError(
                f"{name} has K={k} (shape {list(shape)}), not a multiple of {BLOCK_SIZE}; "
                f"format v1 cannot store it. Leave it dense with --skip {prefix}"
            )
        ok, why = should_quantize(prefix, k, skip)
        if not ok:
            keep.append(prefix)
            report.skipped[prefix] = why
            return False
        report.dense_bytes += n * k * element_size(dtype)
        report.ternary_bytes += n * k // CODES_PER_BYTE + n * (k // BLOCK_SIZE) * 2
        return True

    def make_pair(prefix: str, load: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        packed, scale = quantizer(prefix, load())
        check_shapes(packed, scale, prefix)
        return packed, scale

    report.quantized = _write(src_p, Path(dst), decide, make_pair, {}, keep, overwrite, progress)
    return report


# --- the ``ternop quantize`` subcommand ---


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="Hugging Face model folder with fp32/fp16/bf16 *.safetensors")
    parser.add_argument("dst", help="output folder for the ternary v1 checkpoint (must not exist or be empty)")
    parser.add_argument("--method", choices=sorted(METHODS), default="optimal",
                        help="how each 128-weight block is made ternary (default: optimal, the L2-optimal threshold)")
    parser.add_argument("--skip", nargs="+", default=[], metavar="PATTERN",
                        help="keep modules whose name matches PATTERN (glob, anywhere in the name) dense")
    parser.add_argument("--calib", metavar="FILE", default=None, help="calibration text, for --method calibrated")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    try:
        report = quantize_checkpoint(args.src, args.dst, method=args.method, skip=args.skip,
                                     progress=not args.quiet, calib=args.calib, overwrite=args.force)  # fmt: skip
    except (CheckpointError, ValueError) as e:
        print(f"ternop quantize: error: {e}", file=sys.stderr)
        return 2
    print(f"{report} -> {report.dst}")
    return 0

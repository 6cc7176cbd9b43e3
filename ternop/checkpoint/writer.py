"""Writing format-v1 checkpoints, tensor by tensor, into a folder that appears whole or not at all.

``stream_checkpoint`` is the one writer: the output header is planned from the input shapes,
then each tensor is read, transformed and written before the next is read, so peak memory is
about one tensor. ``write_checkpoint`` feeds it layers made elsewhere (calibration,
distillation); ``ternop.quant.convert.quantize_checkpoint`` feeds it a quantizer.

The output is built in a hidden sibling folder (``.DST.partial-*``) that is removed on any
error or interrupt and renamed into place at the end, with the permissions a plain
``mkdir`` would give.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from ternop.checkpoint.reader import (
    PACKED_SUFFIX,
    QUANT_METHOD,
    SCALE_SUFFIX,
    CheckpointError,
    load_config,
    safetensors_files,
    tensor_index,
)
from ternop.checkpoint.safetensors_io import read_header, write_safetensors
from ternop.format import (
    BLOCK_SIZE,
    CODES_PER_BYTE,
    DEFAULT_ACTIVATION_BITS,
    FORMAT_VERSION,
    PACKED_DTYPE,
    SCALE_DTYPE,
    FormatError,
    check_activation_bits,
    check_shapes,
)

Decide = Callable[[str, tuple[int, ...], torch.dtype], bool]
MakePair = Callable[[str, Callable[[], torch.Tensor]], "tuple[torch.Tensor, torch.Tensor]"]


def check_destination(src: str | os.PathLike, dst: str | os.PathLike, overwrite: bool) -> None:
    """CheckpointError unless ``dst`` may be written: not the source, and absent or empty unless ``overwrite``."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise CheckpointError(f"destination {str(dst)!r} is the source folder; choose another folder")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"destination {str(dst)!r} is a file, not a folder")
    if dst.exists() and not overwrite and any(dst.iterdir()):
        raise CheckpointError(f"destination {str(dst)!r} exists and is not empty (use --force to replace it)")


def check_not_quantized(src: str | os.PathLike) -> None:
    """CheckpointError if the folder already holds a quantized model."""
    qc = load_config(src).get("quantization_config")
    if qc is not None:
        raise CheckpointError(
            f"{str(src)!r} is already quantized (config.json has quantization_config with "
            f"quant_method={qc.get('quant_method')!r}); start from the floating-point model"
        )
    for name, info in tensor_index(src).items():
        if name.endswith(PACKED_SUFFIX):
            raise CheckpointError(f"{str(src)!r} is already quantized: {info.file.name} holds {name}")


def _mkdir_mode() -> int:
    """The mode ``mkdir`` gives a new folder under the current umask (tempfile's folders are 0700)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


@contextlib.contextmanager
def atomic_folder(dst: str | os.PathLike) -> Iterator[Path]:
    """Yields a hidden temporary folder beside ``dst``; on success it replaces ``dst``, on any error it is removed."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        os.chmod(tmp, _mkdir_mode())
        yield tmp
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.rename(dst, old / dst.name)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:  # also KeyboardInterrupt and the CLI's SIGTERM exit: never leave a partial folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy_others(src: Path, tmp: Path, quant_config: dict, renamed: Mapping[str, list[str]]) -> None:
    """Copies every non-safetensors file; patches config.json and any safetensors index."""
    for item in src.iterdir():
        dst = tmp / item.name
        if item.is_dir():
            shutil.copytree(item, dst)
        elif item.name == "config.json":
            config = load_config(src)
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


def quant_config(modules_to_not_convert: Iterable[str], activation_bits: int = DEFAULT_ACTIVATION_BITS) -> dict:
    """The ``quantization_config`` of a v1 checkpoint; CheckpointError for an unknown ``activation_bits``."""
    try:
        bits = check_activation_bits(activation_bits, "the checkpoint to write")
    except FormatError as e:
        raise CheckpointError(str(e)) from None
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "block_size": BLOCK_SIZE,
        "modules_to_not_convert": sorted(set(modules_to_not_convert)),
        "activation_bits": bits,
    }


def stream_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    decide: Decide,
    make_pair: MakePair,
    modules_to_not_convert: Iterable[str] | Callable[[], Iterable[str]],
    overrides: Mapping[str, torch.Tensor] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    activation_bits: int = DEFAULT_ACTIVATION_BITS,
) -> list[str]:
    """Writes a v1 checkpoint at ``dst`` from the HF folder ``src``; returns the quantized prefixes.

    ``decide(name, shape, dtype)`` says whether the tensor ``name`` (any ``.weight``) becomes
    ternary; ``make_pair(prefix, load_weight)`` returns its (packed, scale). Any other tensor
    is taken from ``overrides`` if there, else copied. ``modules_to_not_convert`` (or a
    function returning it, called once every tensor has been decided) goes into config.json,
    with ``activation_bits`` (16: activations as given; 8: int8 per token).
    """
    from safetensors import safe_open
    from tqdm import tqdm

    src, dst, overrides = Path(src), Path(dst), dict(overrides or {})
    quant_config([], activation_bits)  # an unknown activation_bits fails before anything is read
    files = safetensors_files(src)
    check_destination(src, dst, overwrite)
    plans, quantized, renamed, seen = [], [], {}, set()
    for file in files:
        infos, metadata = read_header(file)
        plan = []
        for info in infos:
            name, shape = info.name, info.shape
            seen.add(name)
            if name.endswith(".weight") and decide(name, shape, info.dtype):
                prefix = name[: -len(".weight")]
                n, k = shape
                plan.append((prefix + PACKED_SUFFIX, PACKED_DTYPE, (n, k // CODES_PER_BYTE)))
                plan.append((prefix + SCALE_SUFFIX, SCALE_DTYPE, (n, k // BLOCK_SIZE)))
                quantized.append(prefix)
                renamed[name] = [prefix + PACKED_SUFFIX, prefix + SCALE_SUFFIX]
            elif name in overrides:
                plan.append((name, overrides[name].dtype, tuple(overrides[name].shape)))
            else:
                plan.append((name, info.dtype, shape))
        plans.append((file, plan, metadata))
    unknown = sorted(set(overrides) - seen)
    if unknown:
        raise CheckpointError(f"overrides name tensors that are not in the source: {unknown[:5]}")
    dense = modules_to_not_convert() if callable(modules_to_not_convert) else modules_to_not_convert
    with atomic_folder(dst) as tmp:
        _copy_others(src, tmp, quant_config(dense, activation_bits), renamed)
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
                        check_shapes(packed, scale, prefix)
                        bar.update(1)
                        pending[prefix + SCALE_SUFFIX] = scale
                        return packed
                    if out_name in overrides:
                        return overrides[out_name]
                    return f.get_tensor(out_name)

                write_safetensors(tmp / file.name, plan, produce, metadata)
        bar.close()
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
    activation_bits: int = DEFAULT_ACTIVATION_BITS,
) -> None:
    """Writes a v1 checkpoint at ``dst_dir`` from the HF folder ``src_dir`` and ready-made ternary layers.

    ``quantized`` maps a checkpoint prefix (``encoder.layer.0.attention.self.query``) to its
    (weight_packed uint8 [N, K/4], weight_scale float16 [N, K/128]); its ``<prefix>.weight``
    is replaced. Any other tensor is taken from ``overrides`` if present there, else copied.
    ``modules_to_not_convert`` lists the linear layers left dense (docs/FORMAT.md);
    ``activation_bits`` (16 or 8) is the mode the layers run in.
    """
    quant_config([], activation_bits)
    check_not_quantized(src_dir)
    index = tensor_index(src_dir)
    missing = sorted(p for p in quantized if p + ".weight" not in index)
    if missing:
        raise CheckpointError(f"quantized layers with no <prefix>.weight in {str(src_dir)!r}: {missing[:5]}")
    for prefix, (packed, scale) in quantized.items():
        n, k = check_shapes(packed, scale, prefix)
        shape = index[prefix + ".weight"].shape
        if (n, k) != shape:
            raise CheckpointError(f"{prefix}: ternary layer is [N, K] = {[n, k]}, but {prefix}.weight is {list(shape)}")

    def decide(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return name[: -len(".weight")] in quantized

    stream_checkpoint(src_dir, dst_dir, decide=decide, make_pair=lambda prefix, _load: quantized[prefix],
                      modules_to_not_convert=modules_to_not_convert, overrides=overrides, overwrite=overwrite,
                      progress=progress, activation_bits=activation_bits)  # fmt: skip

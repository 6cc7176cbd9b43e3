"""A trained ternary model as a small file: its ternary layers and trained norms/biases, nothing else.

A distilled checkpoint differs from its fp base only in the ternary layers (``weight_packed``,
``weight_scale``) and in the biases and norms that distillation trains; embeddings and every
other tensor are the base's. :func:`extract` keeps just those tensors (about 3 MB for
all-MiniLM-L6-v2 against 90 MB for the checkpoint) and :func:`save` writes them as one
safetensors file whose metadata holds the ``quantization_config``. :func:`assemble` writes the
full v1 checkpoint again from that file and the fp base folder, after checking the file's sha256
when one is given. The result is the same checkpoint, tensor for tensor, when the base is the
one the model was trained from.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ternop.checkpoint import tensor_index, write_checkpoint

PACKED, SCALE = ".weight_packed", ".weight_scale"
_META_KEY = "quantization_config"


class ArtifactError(ValueError):
    """An artifact file that is missing, altered, or does not fit the base model."""


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_all(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise ArtifactError(f"no *.safetensors in {str(folder)!r}")
    return out


def extract(ckpt: str | os.PathLike, base: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, quantization_config): the ternary layers of ``ckpt`` and every tensor that differs from ``base``.

    Embedding tables are never kept (distillation does not train them; a differing one means a different base).
    """
    ckpt, base = Path(ckpt), Path(base)
    config = json.loads((ckpt / "config.json").read_text())
    qc = config.get(_META_KEY)
    if not qc or qc.get("quant_method") != "ternary":
        raise ArtifactError(f"{str(ckpt)!r} is not a ternary checkpoint (no quantization_config ternary)")
    tensors, fp = _load_all(ckpt), _load_all(base)
    keep = {}
    for name, t in tensors.items():
        if name.endswith((PACKED, SCALE)):
            keep[name] = t
        elif name not in fp:
            raise ArtifactError(f"{name} of {str(ckpt)!r} is not in the base {str(base)!r}")
        elif not torch.equal(t, fp[name].to(t.dtype)):
            if "embeddings" in name:
                raise ArtifactError(f"{name} differs from the base's: {str(ckpt)!r} was not made from {str(base)!r}")
            keep[name] = t.contiguous()
    return keep, qc


def save(tensors: dict[str, torch.Tensor], quant_config: dict, path: str | os.PathLike) -> str:
    """Writes the artifact file and returns its sha256."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={_META_KEY: json.dumps(quant_config, sort_keys=True)})
    return sha256_of(path)


def load(path: str | os.PathLike, sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, quantization_config) of an artifact file; with ``sha256``, the file must have that hash."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"artifact {str(path)!r} does not exist")
    if sha256 is not None:
        got = sha256_of(path)
        if got != sha256.lower():
            raise ArtifactError(f"artifact {str(path)!r} has sha256 {got}, expected {sha256.lower()}: the file was altered")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if _META_KEY not in meta:
        raise ArtifactError(f"artifact {str(path)!r} has no {_META_KEY} in its metadata")
    return tensors, json.loads(meta[_META_KEY])


def assemble(path: str | os.PathLike, base: str | os.PathLike, dst: str | os.PathLike, *, sha256: str | None = None,
             overwrite: bool = False, progress: bool = False) -> dict:  # fmt: skip
    """Writes the v1 checkpoint ``dst`` from the artifact ``path`` and the fp base folder; returns its quantization_config."""
    tensors, qc = load(path, sha256)
    index = tensor_index(base)
    quantized, overrides = {}, {}
    for name, t in tensors.items():
        if name.endswith(PACKED):
            prefix = name[: -len(PACKED)]
            if prefix + SCALE not in tensors:
                raise ArtifactError(f"artifact {str(path)!r}: {prefix} has {PACKED} but no {SCALE}")
            quantized[prefix] = (t, tensors[prefix + SCALE])
        elif name.endswith(SCALE):
            if name[: -len(SCALE)] + PACKED not in tensors:
                raise ArtifactError(f"artifact {str(path)!r}: {name} has no {PACKED}")
        elif name not in index:
            raise ArtifactError(f"artifact {str(path)!r}: {name} is not a tensor of the base {str(base)!r}")
        elif tuple(index[name].shape) != tuple(t.shape):
            raise ArtifactError(f"artifact {str(path)!r}: {name} is {list(t.shape)}, the base's is {list(index[name].shape)}")
        else:
            overrides[name] = t
    write_checkpoint(base, dst, quantized, modules_to_not_convert=qc.get("modules_to_not_convert", []),
                     overrides=overrides, progress=progress, overwrite=overwrite,
                     activation_bits=qc.get("activation_bits", 16))  # fmt: skip
    return qc

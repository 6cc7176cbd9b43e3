"""How far bf16 rounding alone moves embeddings when tensor parallelism splits the row-parallel layers.

At tensor_parallel_size=2, each row-parallel linear (attention output, MLP down) computes two
partial products over half of K, each rounded to bf16, and the all-reduce adds them in bf16.
That changes the result of a bf16 model by rounding alone, whatever the weights are. This
script measures that change on CPU with Hugging Face transformers only (no ternop kernel,
no vLLM), for the same Qwen3-shaped models that ``gpu/vllm_plugin_gpu.py --tp 2`` compares:
the unquantized source model and its ternary checkpoint (dense weights rebuilt from the codes).

For each model and prompt it reports the cosine between:
  * bf16 and the fp32 reference (what bf16 costs at all);
  * bf16 with the row-parallel layers split in two and bf16 without (what TP=2 costs in bf16).

    python benchmarks/tp_rounding.py --json benchmarks/results/cpu/tp_rounding.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROW_PARALLEL = ("o_proj", "down_proj")  # the Qwen3 linears vLLM shards along K


class SplitK(torch.nn.Module):
    """A linear computed as `parts` partial products over slices of K, each in the input dtype, then summed.

    This is what a row-parallel layer does across `parts` ranks: every rank rounds its partial
    result to the activation dtype, and the all-reduce adds the rounded partials.
    """

    def __init__(self, linear: torch.nn.Linear, parts: int):
        super().__init__()
        self.linear, self.parts = linear, parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        k = w.shape[1] // self.parts
        out = None
        for i in range(self.parts):
            part = torch.nn.functional.linear(x[..., i * k : (i + 1) * k], w[:, i * k : (i + 1) * k])
            out = part if out is None else out + part
        return out if self.linear.bias is None else out + self.linear.bias


def split_row_parallel(model: torch.nn.Module, parts: int) -> int:
    """Replace every row-parallel linear of a Qwen3 model by SplitK; returns how many were replaced."""
    targets = [(name, m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in ROW_PARALLEL]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, SplitK(module, parts))
    return len(targets)


def _cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    a = torch.nn.functional.normalize(a.float(), dim=-1)
    b = torch.nn.functional.normalize(b.float(), dim=-1)
    return [round(float(c), 7) for c in (a * b).sum(-1)]


def measure(model: torch.nn.Module, tokenizer_dir: Path, prompts: list[str], parts: int) -> dict:
    from tests.models import hf_embed

    fp32 = hf_embed(model, tokenizer_dir, prompts, "last")
    model = model.to(torch.bfloat16)
    bf16 = hf_embed(model, tokenizer_dir, prompts, "last")
    layers = split_row_parallel(model, parts)
    bf16_split = hf_embed(model, tokenizer_dir, prompts, "last")
    to_fp32, split = _cosines(bf16, fp32), _cosines(bf16_split, bf16)
    return {"split_layers": layers, "min_cosine_bf16_vs_fp32": min(to_fp32), "min_cosine_split_vs_unsplit": min(split),
            "cosines_bf16_vs_fp32": to_fp32, "cosines_split_vs_unsplit": split}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--parts", type=int, default=2, help="ranks the row-parallel layers are split over")
    args = parser.parse_args()

    from transformers import AutoModel

    from ternop.quant.convert import quantize_checkpoint
    from tests.models import PROMPTS, hf_model_from_checkpoint, qwen3_medium, tiny_qwen3

    prompts = PROMPTS * 4  # the prompts gpu/vllm_plugin_gpu.py embeds
    results: dict = {"parts": args.parts, "torch": torch.__version__, "models": {}}
    with tempfile.TemporaryDirectory(prefix="ternop-tp-rounding-") as tmp:
        work = Path(tmp)
        for name, build in (("qwen3-medium", qwen3_medium), ("tiny-qwen3", tiny_qwen3)):
            fp = build(work / f"{name}-fp")
            quantize_checkpoint(fp, work / name, progress=False)
            for label, model in ((f"{name}-fp", AutoModel.from_pretrained(str(fp), dtype=torch.float32).eval()),
                                 (name, hf_model_from_checkpoint(work / name))):  # fmt: skip
                res = results["models"][label] = measure(model, fp, prompts, args.parts)
                print(f"{label:18s} bf16 vs fp32 min cos {res['min_cosine_bf16_vs_fp32']:.7f}   "
                      f"TP={args.parts} split vs unsplit (bf16) min cos {res['min_cosine_split_vs_unsplit']:.7f}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

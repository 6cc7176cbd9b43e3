"""Refits the last LayerNorm of the demo's distilled MiniLM to the fp32 model, in closed form.

    python benchmarks/quality_ln_refit.py [--artifact FILE] [--texts 2000] [--work DIR]
        [--out benchmarks/results/cpu/ln_refit.json] [--force]

all-MiniLM-L6-v2 mean-pools its last LayerNorm's output, so a per-dimension scale and shift of
that norm (its weight and bias, 2 x 384 numbers) is a per-dimension scale and shift of the pooled
embedding before it is normalised. This fits both by least squares, dimension by dimension, so
that the ternary model's pooled embeddings match the fp32 model's on ``--texts`` training texts
(drawn by length like distillation's batches; no evaluation text is in them), writes the
checkpoint with the refitted norm and scores it, beside the artifact as it is, on the visible
sets and the held-out split: whether a fit with no training moves the cosine to fp32 towards
the 0.90 target without costing retrieval. It writes two checkpoint folders under ``--work`` and
the ``--out`` JSON, and replaces none of them that already exist unless given ``--force``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quality_minilm import minilm_dir, score  # noqa: E402
from quality_mixed_distilled import ARTIFACT, _shown  # noqa: E402
from stamp import git_commit  # noqa: E402

NORM = "encoder.layer.5.output.LayerNorm"


def pooled(model, tok, texts: list[str], batch_size: int = 32, max_length: int = 256, norm=None) -> torch.Tensor:
    """Mean-pooled token states [len(texts), D]: the model's last hidden state, or, with ``norm``
    (a LayerNorm module of the model), that norm's input standardised (before its weight and bias)."""
    seen = {}
    hook = None
    if norm is not None:
        def standardise(module, inputs, output):
            z = inputs[0]
            seen["z"] = (z - z.mean(-1, keepdim=True)) / torch.sqrt(z.var(-1, unbiased=False, keepdim=True)
                                                                    + module.eps)  # fmt: skip
        hook = norm.register_forward_hook(standardise)
    out = []
    try:
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                batch = tok(texts[i : i + batch_size], padding=True, truncation=True, max_length=max_length,
                            return_tensors="pt")  # fmt: skip
                mask = batch["attention_mask"].unsqueeze(-1).float()
                states = model(**batch).last_hidden_state
                states = seen["z"] if norm is not None else states
                out.append((states * mask).sum(1) / mask.sum(1))
    finally:
        if hook is not None:
            hook.remove()
    return torch.cat(out)


def fit_affine(z: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column d, the least-squares (a_d, c_d) of target[:, d] ~ a_d * z[:, d] + c_d."""
    zm, tm = z.mean(0), target.mean(0)
    a = ((z - zm) * (target - tm)).sum(0) / ((z - zm) ** 2).sum(0)
    return a, tm - a * zm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, default=ARTIFACT)
    p.add_argument("--texts", type=int, default=2000, help="training texts to fit on")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("work/ln_refit"))
    p.add_argument("--out", type=Path, default=HERE / "results" / "cpu" / "ln_refit.json")
    p.add_argument("--force", action="store_true", help="replace the --work folders and --out if they exist")
    args = p.parse_args(argv)
    start, refit = args.work / "artifact", args.work / "refit"
    existing = [str(q) for q in (start, refit, args.out) if q.exists()]
    if existing and not args.force:
        p.error(f"{', '.join(existing)} already exist(s); pass --force to replace")

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ternop.cli import evaldata, traindata
    from ternop.hf.loading import load_model, load_tokenizer
    from ternop.quant import artifact
    from ternop.quant.batches import Sampler

    base = Path(minilm_dir())
    artifact.assemble(args.artifact, base, start, overwrite=True)
    texts = Sampler(traindata.training_texts(), 8, (0.2, 0.3, 0.5), args.seed).calibration(args.texts)
    t0 = time.time()
    tok = load_tokenizer(str(base))
    teacher = load_model(str(base), causal=False, dense=True).eval()
    student = load_model(str(start), causal=False, dense=True).eval()
    norm = student.get_submodule(NORM)
    target = pooled(teacher, tok, texts)
    z = pooled(student, tok, texts, norm=norm)
    weight, bias = fit_affine(z, target)
    cos = torch.nn.functional.cosine_similarity
    fit_cos = {"artifact": float(cos(z * norm.weight.detach() + norm.bias.detach(), target).mean()),
               "refit": float(cos(z * weight + bias, target).mean())}  # fmt: skip
    seconds = time.time() - t0

    if refit.exists():
        shutil.rmtree(refit)
    shutil.copytree(start, refit)
    file = refit / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        metadata = f.metadata()
    state = load_file(str(file))
    for key, value in ((NORM + ".weight", weight), (NORM + ".bias", bias)):
        state[key] = value.to(state[key].dtype)
    save_file(state, str(file), metadata=metadata)

    suite = evaldata.suite()
    fp32, ref = score(str(base), suite, None)
    rows = {"fp32": fp32}
    for name, path in (("all ternary (the artifact)", start), ("last LayerNorm refitted", refit)):
        rows[name], _ = score(str(path), suite, ref)
    report = {
        "commit": git_commit(),
        "artifact": _shown(args.artifact),
        "artifact_sha256": artifact.sha256_of(args.artifact),
        "norm": NORM,
        "fit_texts": len(texts),
        "fit_text_mix": "Sampler(training_texts(), 8, (0.2, 0.3, 0.5), seed).calibration(texts): 20% single "
                        "words, 30% short, 50% long",
        "seed": args.seed,
        "fit_set_mean_cosine_to_fp32": fit_cos,
        "seconds_to_fit": round(seconds, 1),
        "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    keys = ("wiki_mrr", "cos_mean", "heldout_passage_mrr", "heldout_short_mrr", "heldout_cos_mean")
    print(f"{'':28s}" + "".join(f"{k:>22s}" for k in keys))
    for name, row in rows.items():
        print(f"{name:28s}" + "".join(f"{row[k]:22.4f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())

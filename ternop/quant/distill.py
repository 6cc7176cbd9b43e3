"""``ternop distill``: quantization-aware distillation of an embedding model into ternary weights.

The student is the base model with every selected linear layer (``ternop.selection``) made
ternary by a straight-through estimator: the forward pass uses ``s * round(clamp(W / s, -1, 1))``
per 128-block along K, from latent dense weights ``W`` and learnable per-block scales ``s``; the
backward pass treats the rounding as the identity (gradients reach both W and s). Biases and
norms train too; embeddings stay frozen. The teacher is the fp base model. The loss is
``1 - cos`` between student and teacher sentence embeddings (the model's own pooling), plus
``--hidden-weight`` times the teacher-normalised MSE of the last hidden states (real tokens).

The student starts from the calibrated ternarization (``ternop.calibrate``) or from optimal
rounding. State (latent weights, scales, optimizer, step) is saved to ``DST.distill-state.pt``
every ``--save-every`` steps; ``--resume`` continues from it. At the end the codes and scales
are written as a standard format-v1 checkpoint (``ternop.checkpoint.write_checkpoint``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ternop.format import BLOCK_SIZE, SCALE_DTYPE


class QATLinear(nn.Module):
    """Linear layer trained through ternary rounding. Parameters: ``weight`` [N, K] (latent),
    ``scale`` [N, K/128] fp32, ``bias`` [N] or None."""

    def __init__(self, latent: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        n, k = latent.shape
        if k % BLOCK_SIZE or tuple(scale.shape) != (n, k // BLOCK_SIZE):
            raise ValueError(f"latent [N, K] = {list(latent.shape)} needs scale [N, K/128], got {list(scale.shape)}")
        self.weight = nn.Parameter(latent.detach().float().clone())
        self.scale = nn.Parameter(scale.detach().float().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())

    def _ratio(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.scale.abs().clamp(min=1e-8).repeat_interleave(BLOCK_SIZE, dim=1)
        return self.weight / s, s

    def values(self) -> torch.Tensor:
        """Current ternary values, int8 [N, K]."""
        with torch.no_grad():
            r, _ = self._ratio()
            return torch.round(torch.clamp(r, -1.0, 1.0)).to(torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, s = self._ratio()
        t = torch.round(torch.clamp(r, -1.0, 1.0))
        # Straight-through: the value is s * t, the gradient that of s * r.
        w = s * (r + (t - r).detach())
        return nn.functional.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def _init_values(student, tokenizer, texts, init: str, skip, calib_tokens: int, progress: bool):
    """name -> (values int8 [N, K], scale fp32 [N, K/128]) for the selected linears."""
    from ternop.quant.calibrate import _target_linears, calibrate_model
    from ternop.quantize import quantize_to_values

    if init == "calibrated":
        res = calibrate_model(student, tokenizer, texts, skip, max_tokens=calib_tokens, progress=progress)
        return {name: (v, s.float()) for name, (v, s) in res.items()}
    out = {}
    for name, layer in _target_linears(student, skip).items():
        v, s = quantize_to_values(layer.weight.detach(), init)
        out[name] = (v, s.float())
    return out


def build_student(student: nn.Module, init_values: dict) -> dict[str, QATLinear]:
    """Replaces, in place, each named nn.Linear by a QATLinear whose latent weight is its ternary init."""
    layers = {}
    for name, (values, scale) in init_values.items():
        parent_name, _, child = name.rpartition(".")
        parent = student.get_submodule(parent_name) if parent_name else student
        old = getattr(parent, child)
        latent = values.float() * scale.repeat_interleave(BLOCK_SIZE, dim=1)
        layer = QATLinear(latent, scale, old.bias).to(old.weight.device)
        setattr(parent, child, layer)
        layers[name] = layer
    return layers


def _trainable(student: nn.Module) -> list[tuple[str, nn.Parameter]]:
    out = []
    for name, p in student.named_parameters():
        frozen = "embed" in name.lower() or name.startswith("pooler.") or ".pooler." in name
        p.requires_grad_(not frozen)
        if not frozen:
            out.append((name, p))
    return out


def distill_loss(student, teacher, batch, pooling: str, hidden_weight: float) -> tuple[torch.Tensor, dict]:
    from ternop.cli.evaldata import pool

    with torch.no_grad():
        th = teacher(**batch).last_hidden_state.float()
        te = pool(th, batch["attention_mask"], pooling)
    sh = student(**batch).last_hidden_state.float()
    se = pool(sh, batch["attention_mask"], pooling)
    cos = (se * te).sum(-1)
    loss = (1.0 - cos).mean()
    stats = {"cos": float(cos.detach().mean())}
    if hidden_weight > 0:
        m = batch["attention_mask"].bool()
        mse = ((sh - th)[m] ** 2).mean() / (th[m] ** 2).mean().clamp(min=1e-12)
        loss = loss + hidden_weight * mse
        stats["hmse"] = float(mse.detach())
    return loss, stats


def export(
    base: str, dst: str, student: nn.Module, layers: dict[str, QATLinear], skipped: list[str], progress: bool = True
) -> None:
    """Writes the student as a v1 checkpoint at ``dst`` (replacing it): ternary layers + trained biases/norms."""
    from safetensors import safe_open

    from ternop.quant.calibrate import to_packed
    from ternop.checkpoint import _safetensors_files, write_checkpoint

    keys, dtypes = set(), {}
    for file in _safetensors_files(Path(base)):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                keys.add(k)
                dtypes[k] = f.get_slice(k).get_dtype()
    prefix = getattr(student, "base_model_prefix", "")

    def ckpt_name(name: str) -> str | None:
        for cand in (name, f"{prefix}.{name}"):
            if cand in keys:
                return cand
        return None

    quantized, overrides = {}, {}
    for name, layer in layers.items():
        values = layer.values()
        scale = layer.scale.detach().float().cpu()
        neg = (scale < 0).repeat_interleave(BLOCK_SIZE, dim=1)
        values = torch.where(neg, -values.cpu(), values.cpu())
        key = ckpt_name(name + ".weight")
        if key is None:
            raise ValueError(f"{name}: no {name}.weight in the base checkpoint {base!r}")
        quantized[key[: -len(".weight")]] = to_packed(values, scale.abs().to(SCALE_DTYPE))
    st_to_torch = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    for name, p in student.named_parameters():
        if name.endswith(".weight") and name[: -len(".weight")] in layers or name.endswith(".scale"):
            continue
        key = ckpt_name(name)
        if key is not None and p.requires_grad:
            overrides[key] = p.detach().cpu().to(st_to_torch.get(dtypes[key], torch.float32)).contiguous()
    write_checkpoint(base, dst, quantized, modules_to_not_convert=skipped, overrides=overrides,
                     progress=progress, overwrite=True)  # fmt: skip


def _read_data(data: str) -> list[str]:
    if data == "builtin":
        from ternop.cli.evaldata import training_texts

        return training_texts()
    from ternop.quant.calibrate import read_calibration_text

    return read_calibration_text(data)


def run(args: argparse.Namespace) -> dict:
    """The whole distillation; returns a summary dict (steps, final loss/cos, seconds)."""
    from tqdm import tqdm

    from ternop.quant.calibrate import _target_linears
    from ternop.cli.evaldata import load_hf, pooling_mode

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    state_path = Path(args.state or f"{str(args.dst).rstrip('/')}.distill-state.pt")
    texts = _read_data(args.data)
    teacher, tokenizer = load_hf(args.base)
    student, _ = load_hf(args.base)
    pooling = pooling_mode(args.base)
    skipped = [
        n for n, m in student.named_modules() if isinstance(m, nn.Linear) and n not in _target_linears(student, args.skip)
    ]
    state = torch.load(state_path, map_location="cpu") if args.resume and state_path.exists() else None
    if args.resume and state is None:
        print(f"ternop distill: no state at {state_path}; starting from scratch", file=sys.stderr)
    t0 = time.time()
    if state is None:
        init = _init_values(student, tokenizer, texts, args.init, args.skip, args.calib_tokens, not args.quiet)
    else:
        # Shapes only: the saved state overwrites values and scales below.
        init = {n: (torch.zeros_like(m.weight, dtype=torch.int8), torch.ones(m.out_features, m.in_features // BLOCK_SIZE))
                for n, m in _target_linears(student, args.skip).items()}  # fmt: skip
    layers = build_student(student, init)
    teacher.to(device).eval()
    student.to(device).train()
    # Dropout would make the student chase a moving target on a few hundred steps.
    for m in student.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    params = _trainable(student)
    groups = [
        {"params": [p for n, p in params if n.endswith(".scale")], "lr": args.lr_scale},
        {"params": [p for n, p in params if not n.endswith(".scale")], "lr": args.lr},
    ]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    step = 0
    if state is not None:
        student.load_state_dict(state["student"], strict=False)
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
    total = args.steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(0.05, 1.0 - i / max(1, total)), last_epoch=step - 1)
    bar = tqdm(total=total, initial=step, unit="step", desc="distill", file=sys.stderr, disable=args.quiet)
    stats: dict = {}
    stop_at = min(total, args.stop_at or total)
    while step < stop_at:
        rng = random.Random(args.seed * 1_000_003 + step)
        batch_texts = rng.sample(texts, min(args.batch_size, len(texts)))
        batch = tokenizer(batch_texts, padding=True, truncation=True, max_length=args.seq_len,
                          return_tensors="pt").to(device)  # fmt: skip
        loss, stats = distill_loss(student, teacher, batch, pooling, args.hidden_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        stats["loss"] = float(loss.detach())
        bar.update(1)
        bar.set_postfix({k: f"{v:.4f}" for k, v in stats.items()}, refresh=False)
        if step % args.save_every == 0 or step == stop_at:
            trainable = {n for n, _ in params}
            tmp = state_path.with_suffix(".tmp")
            torch.save({"step": step, "optimizer": opt.state_dict(),
                        "student": {k: v for k, v in student.state_dict().items() if k in trainable}}, tmp)  # fmt: skip
            tmp.replace(state_path)
    bar.close()
    if step < total:
        return {"steps": step, "seconds": time.time() - t0, "stopped": True, **stats}
    student.eval()
    export(args.base, args.dst, student.cpu(), layers, skipped, progress=not args.quiet)
    return {"steps": step, "seconds": time.time() - t0, **stats}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", help="fp Hugging Face embedding model folder (the teacher and the start)")
    parser.add_argument("dst", help="output folder for the ternary v1 checkpoint (replaced if it exists)")
    parser.add_argument("--data", default="builtin",
                        help="training text file, one text per line; 'builtin' = ternop.evaldata.training_texts() "
                             "(disjoint from the evaluation sets)")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per text at most")
    parser.add_argument("--lr", type=float, default=2e-4, help="learning rate of latent weights, biases, norms")
    parser.add_argument("--lr-scale", type=float, default=1e-4, help="learning rate of the block scales")
    parser.add_argument("--hidden-weight", type=float, default=1.0,
                        help="weight of the hidden-state MSE term (0 = embedding cosine only)")
    parser.add_argument("--init", choices=["calibrated", "optimal", "absmean"], default="calibrated")
    parser.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens for --init calibrated")
    parser.add_argument("--skip", nargs="+", default=[], metavar="PATTERN", help="keep matching modules dense")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--resume", action="store_true", help="continue from the saved state")
    parser.add_argument("--state", default=None, help="state file (default: DST.distill-state.pt)")
    parser.add_argument("--save-every", type=int, default=50, help="save the state every N steps")
    parser.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                        help="save the state and stop after STEP (continue later with --resume)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.steps < 1:
        print(f"ternop distill: error: --steps must be >= 1, got {args.steps}", file=sys.stderr)
        return 2
    try:
        summary = run(args)
    except (ValueError, OSError) as e:
        print(f"ternop distill: error: {e}", file=sys.stderr)
        return 2
    if summary.get("stopped"):
        print(f"stopped at step {summary['steps']} of {args.steps}; continue with --resume")
        return 0
    print(f"distilled {summary['steps']} steps in {summary['seconds']:.0f} s "
          f"(last batch cosine {summary.get('cos', float('nan')):.4f}) -> {args.dst}")  # fmt: skip
    return 0

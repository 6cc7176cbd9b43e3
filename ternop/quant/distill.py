"""Quantization-aware distillation of an embedding model into ternary weights (``ternop distill``).

The student is the base model with every selected linear layer (``ternop.selection``) made
ternary by a straight-through estimator: the forward pass uses ``s * round(clamp(W / s, -1, 1))``
per 128-block along K, from latent dense weights ``W`` and learnable per-block scales ``s``; the
backward pass treats the rounding as the identity (gradients reach both W and s). With
``activation_bits=8`` (``ternop distill --activations int8``) each layer's input is also rounded
per token to int8 exactly as W2A8 rounds it (``ternop.activations.quantize_rows``), again with
the identity as its gradient, so the student trains for the mode it will run in. Biases and
norms train too; embeddings stay frozen. The teacher is the fp base model. The loss is
``1 - cos`` between student and teacher sentence embeddings (the model's own pooling), plus
``hidden_weight`` times the teacher-normalised MSE of the last hidden states (real tokens).

The student starts from the calibrated ternarization (``ternop.quant.calibrate``) or from
optimal rounding. State (latent weights, scales, optimizer, step) is saved every
``save_every`` steps so that a run can stop and resume; it is removed once the checkpoint is
written (unless ``keep_state``). The result is a standard format-v1 checkpoint whose
``quantization_config.activation_bits`` is the mode it was trained for.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ternop.activations import quantize_rows
from ternop.format import BLOCK_SIZE, DEFAULT_ACTIVATION_BITS, SCALE_DTYPE, check_activation_bits
from ternop.selection import select_linears


@dataclass
class DistillConfig:
    """Every knob of a distillation run; ``ternop distill``'s options map one to one."""

    steps: int = 400
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-4
    lr_scale: float = 1e-4
    hidden_weight: float = 1.0
    init: str = "calibrated"
    calib_tokens: int = 8192
    skip: tuple[str, ...] = ()
    device: str = "cpu"
    resume: bool = False
    state: str | None = None
    keep_state: bool = False
    save_every: int = 50
    stop_at: int | None = None
    seed: int = 0
    quiet: bool = False
    overwrite: bool = False
    activation_bits: int = DEFAULT_ACTIVATION_BITS


def default_state_path(dst) -> Path:
    """Where a run's resumable state goes by default: beside DST, as ``DST.distill-state.pt``."""
    return Path(f"{str(dst).rstrip('/')}.distill-state.pt")


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x rounded per token to int8 and back (fp32), as W2A8 rounds it; the gradient is the identity.

    The value is ``q * s_x`` of ``ternop.activations.quantize_rows`` (absmax per token, round half
    to even, clamp to +-127), so ``x_q @ (t * s).T`` is the W2A8 product up to the order of fp32 sums.
    """
    q, sx = quantize_rows(x.detach().reshape(-1, x.shape[-1]))
    xq = (q.to(torch.float32) * sx[:, None]).view(x.shape)
    # Straight-through: the value is exactly xq (x - x.detach() is 0), the gradient that of x.
    return xq + (x - x.detach()).to(torch.float32)


class QATLinear(nn.Module):
    """Linear layer trained through ternary rounding. Parameters: ``weight`` [N, K] (latent),
    ``scale`` [N, K/128] fp32, ``bias`` [N] or None. ``activation_bits=8`` also rounds the input
    per token to int8 (:func:`int8_activations`)."""

    def __init__(self, latent: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 activation_bits: int = DEFAULT_ACTIVATION_BITS):  # fmt: skip
        super().__init__()
        n, k = latent.shape
        if k % BLOCK_SIZE or tuple(scale.shape) != (n, k // BLOCK_SIZE):
            raise ValueError(f"latent [N, K] = {list(latent.shape)} needs scale [N, K/128], got {list(scale.shape)}")
        self.activation_bits = check_activation_bits(activation_bits, "QATLinear")
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
        # Straight-through: the value is exactly s * t (r - r.detach() is 0), the gradient that of s * r.
        w = s * (t + (r - r.detach()))
        if self.activation_bits == 8:
            x = int8_activations(x).to(x.dtype)
        return nn.functional.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"in_features={k}, out_features={n}, bias={self.bias is not None}, activation_bits={self.activation_bits}"


def _init_values(student, tokenizer, texts, init: str, skip, calib_tokens: int, progress: bool):
    """name -> (values int8 [N, K], scale fp32 [N, K/128]) for the selected linears."""
    from ternop.quant.calibrate import calibrate_model
    from ternop.quantize import quantize_to_values

    if init == "calibrated":
        res = calibrate_model(student, tokenizer, texts, skip, max_tokens=calib_tokens, progress=progress)
        return {name: (v, s.float()) for name, (v, s) in res.items()}
    out = {}
    for name, layer in select_linears(student, skip)[0].items():
        v, s = quantize_to_values(layer.weight.detach(), init)
        out[name] = (v, s.float())
    return out


def build_student(student: nn.Module, init_values: dict,
                  activation_bits: int = DEFAULT_ACTIVATION_BITS) -> dict[str, QATLinear]:  # fmt: skip
    """Replaces, in place, each named nn.Linear by a QATLinear whose latent weight is its ternary init."""
    layers = {}
    for name, (values, scale) in init_values.items():
        parent_name, _, child = name.rpartition(".")
        parent = student.get_submodule(parent_name) if parent_name else student
        old = getattr(parent, child)
        latent = values.float() * scale.repeat_interleave(BLOCK_SIZE, dim=1)
        layer = QATLinear(latent, scale, old.bias, activation_bits).to(old.weight.device)
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
    from ternop.hf.embedding import pool

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


def export(base, dst, student: nn.Module, layers: dict[str, QATLinear], dense: list[str], *,
           progress: bool = True, overwrite: bool = False,
           activation_bits: int = DEFAULT_ACTIVATION_BITS) -> None:  # fmt: skip
    """Writes the student as a v1 checkpoint at ``dst``: ternary layers, and trained biases and norms.

    ``dense`` names the student's linear layers left dense (they go to ``modules_to_not_convert``);
    ``activation_bits`` is written to ``quantization_config``.
    """
    from ternop.checkpoint import tensor_index, write_checkpoint
    from ternop.hf.names import module_to_checkpoint
    from ternop.quant.calibrate import to_packed

    index = tensor_index(base)
    params = dict(student.named_parameters())
    names = module_to_checkpoint(student, [*params, *(f"{n}.weight" for n in dense)], index)
    quantized, overrides = {}, {}
    for name, layer in layers.items():
        values = layer.values().cpu()
        scale = layer.scale.detach().float().cpu()
        # A negative learnt scale is stored positive with its codes flipped (FORMAT.md: writers emit scales >= 0).
        values = torch.where((scale < 0).repeat_interleave(BLOCK_SIZE, dim=1), -values, values)
        key = names.get(name + ".weight")
        if key is None:
            raise ValueError(f"{name}: no {name}.weight in the base checkpoint {str(base)!r}")
        quantized[key[: -len(".weight")]] = to_packed(values, scale.abs().to(SCALE_DTYPE))
    for name, p in params.items():
        if name.endswith(".scale") or (name.endswith(".weight") and name[: -len(".weight")] in layers):
            continue
        if name in names and p.requires_grad:
            key = names[name]
            overrides[key] = p.detach().cpu().to(index[key].dtype).contiguous()
    not_converted = [names[f"{n}.weight"][: -len(".weight")] for n in dense if f"{n}.weight" in names]
    write_checkpoint(base, dst, quantized, modules_to_not_convert=not_converted, overrides=overrides,
                     progress=progress, overwrite=overwrite, activation_bits=activation_bits)  # fmt: skip


def run(base, dst, texts: list[str], args: DistillConfig) -> dict:
    """Distils the fp model in ``base`` on ``texts`` and writes the checkpoint ``dst``.

    Returns a summary: steps, seconds, the last batch's loss and cosine, ``stopped`` when
    ``stop_at`` came first (then nothing is written and the state stays), and ``state``.
    """
    from tqdm import tqdm

    from ternop.hf import load_model, load_tokenizer, pooling_mode

    if not texts:
        raise ValueError("distillation needs at least one training text")
    bits = check_activation_bits(args.activation_bits, "ternop distill")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    state_path = Path(args.state) if args.state else default_state_path(dst)
    teacher, tokenizer = load_model(base, causal=False), load_tokenizer(base)
    student = load_model(base, causal=False)
    pooling = pooling_mode(base)
    targets, dense = select_linears(student, args.skip)
    state = torch.load(state_path, map_location="cpu") if args.resume and state_path.exists() else None
    if args.resume and state is None:
        print(f"ternop distill: no state at {state_path}; starting from scratch", file=sys.stderr)
    if state is not None and int(state.get("activation_bits", DEFAULT_ACTIVATION_BITS)) != bits:
        raise ValueError(
            f"the state in {state_path} was trained with activation_bits {state.get('activation_bits', 16)}, "
            f"not {bits}; resume with the same --activations, or start again without --resume"
        )
    t0 = time.time()
    if state is None:
        init = _init_values(student, tokenizer, texts, args.init, args.skip, args.calib_tokens, not args.quiet)
    else:
        # Shapes only: the saved state overwrites values and scales below.
        init = {n: (torch.zeros_like(m.weight, dtype=torch.int8), torch.ones(m.out_features, m.in_features // BLOCK_SIZE))
                for n, m in targets.items()}  # fmt: skip
    layers = build_student(student, init, bits)
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
            torch.save({"step": step, "optimizer": opt.state_dict(), "activation_bits": bits,
                        "student": {k: v for k, v in student.state_dict().items() if k in trainable}}, tmp)  # fmt: skip
            tmp.replace(state_path)
    bar.close()
    if step < total:
        return {"steps": step, "seconds": time.time() - t0, "stopped": True, "state": str(state_path), **stats}
    student.eval()
    export(base, dst, student.cpu(), layers, list(dense), progress=not args.quiet, overwrite=args.overwrite,
           activation_bits=bits)
    if not args.keep_state:
        state_path.unlink(missing_ok=True)
    return {"steps": step, "seconds": time.time() - t0, "state": str(state_path) if args.keep_state else None, **stats}

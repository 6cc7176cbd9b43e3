"""Quantization-aware distillation of an embedding model into ternary weights (``ternop distill``).

The student is the base model with every selected linear layer (``ternop.selection``) made
ternary by a straight-through estimator: the forward pass uses ``s * round(clamp(W / s, -1, 1))``
per 128-block along K, from latent dense weights ``W`` and learnable per-block scales ``s``; the
backward pass treats the rounding as the identity (gradients reach both W and s). With
``scales="row"`` (``ternop distill --scales row``) each row has one learnable scale instead (the
form the W2A8 kernels sum over all of K, ``ternop.activations``). With
``activation_bits=8`` (``ternop distill --activations int8``) each layer's input is also rounded
per token to int8 exactly as W2A8 rounds it (``ternop.activations.quantize_rows``), again with
the identity as its gradient, so the student trains for the mode it will run in. Biases and
norms train too; embeddings stay frozen. The teacher is the fp base model. The loss
(:mod:`ternop.quant.objectives`) weighs ``1 - cos`` between student and teacher sentence
embeddings (the model's own pooling), in-batch relational distillation (the teacher's similarity
matrix over the batch) and the teacher-normalised MSE of hidden states (real tokens).

On CUDA the fp32 matmuls of training run on TF32 tensor cores (``tf32``, ``ternop distill
--no-tf32`` turns it off); the loss parts are read back from the GPU only every ``log_every``
steps, and AdamW is the fused one, so that the host does not stall the GPU at every step.

Batches and the learning-rate schedule (length mix, warm-up, decay) are :mod:`ternop.quant.batches`.
``time_limit`` (seconds from the start of :func:`run`, loading and calibration included) ends
training in time: every ``save_every`` steps the run re-estimates how many steps fit and shortens
the schedule to them, so the decay still completes (such a run depends on the machine's speed and
is not reproducible step for step). ``log`` appends one JSON line every ``log_every`` steps (the
loss terms averaged over those steps, the learning rates of the weights and of the scales, seconds).

The student starts from the calibrated ternarization (``ternop.quant.calibrate``, on a sample drawn
like the batches), from optimal rounding, or (``init_from``, ``ternop distill --init-from CKPT``)
from a ternary checkpoint of the same base, e.g. an earlier run's output: its codes, scales and
trained biases and norms, with a fresh optimizer and schedule (:mod:`ternop.quant.student_init`), so that
training can go on in runs of any length; such a run keeps the checkpoint's scales unless given a
scale learning rate (``student_init.scales_lr``). State (latent weights, scales, optimizer, step) is
saved every ``save_every`` steps so that a run can stop and resume; it is removed once the
checkpoint is written (unless ``keep_state``). ``export_every`` also writes the student as a v1
checkpoint ``DST.step<N>`` every N steps. The result is a standard format-v1 checkpoint whose
``quantization_config.activation_bits`` is the mode it was trained for.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ternop.activations import quantize_rows
from ternop.format import BLOCK_SIZE, DEFAULT_ACTIVATION_BITS, SCALE_DTYPE, check_activation_bits
from ternop.quant.batches import Sampler, lr_factor
from ternop.quant.calibrate import CALIB_TOKENS
from ternop.quant.objectives import Weights, distill_loss
from ternop.quant.student_init import checkpoint_init, initial_values, scales_lr
from ternop.selection import select_linears


@dataclass
class DistillConfig:
    """Every knob of a distillation run; ``ternop distill``'s options map one to one."""

    steps: int = 400
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-4
    lr_scale: float | None = None  # None: student_init.LR_SCALE, or 0 with init_from (scales_lr says why)
    hidden_weight: float = 1.0
    hidden_layers: str = "last"
    cos_weight: float = 1.0
    rel_weight: float = 0.0
    rel_temp: float = 0.05
    mix: tuple[float, float, float] | None = None
    schedule: str = "linear"
    warmup: int = 0
    export_every: int = 0
    time_limit: float | None = None
    log: str | None = None
    log_every: int = 50
    init: str = "calibrated"
    init_from: str | None = None
    calib_tokens: int = CALIB_TOKENS
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
    scales: str = "block"
    tf32: bool = True


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


def per_weight(scale: torch.Tensor, k: int) -> torch.Tensor:
    """Scales [N, K/128] (a scale per block) or [N, 1] (per row) -> [N, K], one per weight."""
    return scale.expand(-1, k) if scale.shape[1] == 1 else scale.repeat_interleave(BLOCK_SIZE, dim=1)


def stored_scales(scale: torch.Tensor, k: int) -> torch.Tensor:
    """Scales [N, K/128] or [N, 1] -> the [N, K/128] that format v1 stores (a row's scale in each block)."""
    return scale.expand(-1, k // BLOCK_SIZE) if scale.shape[1] == 1 else scale


class QATLinear(nn.Module):
    """Linear layer trained through ternary rounding. Parameters: ``weight`` [N, K] (latent),
    ``scale`` [N, K/128] fp32 (or [N, 1]: one scale per row), ``bias`` [N] or None.
    ``activation_bits=8`` also rounds the input per token to int8 (:func:`int8_activations`)."""

    def __init__(self, latent: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 activation_bits: int = DEFAULT_ACTIVATION_BITS):  # fmt: skip
        super().__init__()
        n, k = latent.shape
        if k % BLOCK_SIZE or tuple(scale.shape) not in ((n, k // BLOCK_SIZE), (n, 1)):
            raise ValueError(
                f"latent [N, K] = {list(latent.shape)} needs scale [N, K/128] or [N, 1], got {list(scale.shape)}"
            )
        self.activation_bits = check_activation_bits(activation_bits, "QATLinear")
        self.weight = nn.Parameter(latent.detach().float().clone())
        self.scale = nn.Parameter(scale.detach().float().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())

    def _ratio(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = per_weight(self.scale.abs().clamp(min=1e-8), self.weight.shape[1])
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


def build_student(student: nn.Module, init_values: dict,
                  activation_bits: int = DEFAULT_ACTIVATION_BITS) -> dict[str, QATLinear]:  # fmt: skip
    """Replaces, in place, each named nn.Linear by a QATLinear whose latent weight is its ternary init."""
    layers = {}
    for name, (values, scale) in init_values.items():
        parent_name, _, child = name.rpartition(".")
        parent = student.get_submodule(parent_name) if parent_name else student
        old = getattr(parent, child)
        latent = values.float() * per_weight(scale, values.shape[1])
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


def _save_state(path: Path, step: int, opt, student, trainable: set[str], bits: int,
                scales: str = "block", skip: tuple[str, ...] = ()) -> None:  # fmt: skip
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "optimizer": opt.state_dict(), "activation_bits": bits, "scales": scales,
                "skip": list(skip),
                "student": {k: v for k, v in student.state_dict().items() if k in trainable}}, tmp)  # fmt: skip
    tmp.replace(path)


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
        scale = stored_scales(layer.scale.detach().float().cpu(), values.shape[1])
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

    run_start = time.time()
    if not texts:
        raise ValueError("distillation needs at least one training text")
    if args.init_from and args.resume:
        raise ValueError("--init-from starts a new run and --resume continues one: give one of them")
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
    if state is not None and state.get("scales", "block") != args.scales:
        raise ValueError(
            f"the state in {state_path} was trained with --scales {state.get('scales', 'block')}, not "
            f"{args.scales}; resume with the same --scales, or start again without --resume"
        )
    if state is not None and "skip" in state and set(state["skip"]) != set(args.skip):
        raise ValueError(
            f"the state in {state_path} was trained with the dense layers (--skip) {state['skip']}, not "
            f"{list(args.skip)}; resume with the same --skip, or start again without --resume"
        )
    weights = Weights(cos=args.cos_weight, rel=args.rel_weight, rel_temp=args.rel_temp, hidden=args.hidden_weight,
                      hidden_layers=args.hidden_layers)
    sampler = Sampler(texts, args.batch_size, args.mix, args.seed)
    lr_factor(0, args.steps, args.schedule, args.warmup)  # a bad schedule fails before calibration
    t0 = time.time()
    if state is None and args.init_from:
        student.to(device)
        init, tensors = checkpoint_init(student, args.init_from, targets, args.scales)
        # Before build_student, which copies each ternary layer's bias from the nn.Linear it replaces.
        student.load_state_dict(tensors, strict=False)
    elif state is None:
        calib = sampler.calibration(4096)
        student.to(device)  # calibration runs where training will
        init = initial_values(student, tokenizer, calib, args.init, args.skip, args.calib_tokens, not args.quiet,
                              args.scales)  # fmt: skip
    else:
        # Shapes only: the saved state overwrites values and scales below.
        blocks = {n: 1 if args.scales == "row" else m.in_features // BLOCK_SIZE for n, m in targets.items()}
        init = {n: (torch.zeros_like(m.weight, dtype=torch.int8), torch.ones(m.out_features, blocks[n]))
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
        {"params": [p for n, p in params if n.endswith(".scale")], "lr": scales_lr(args.lr_scale, args.init_from)},
        {"params": [p for n, p in params if not n.endswith(".scale")], "lr": args.lr},
    ]
    # One fused kernel per step on a GPU instead of a launch per parameter.
    opt = torch.optim.AdamW(groups, weight_decay=0.0, fused=True if device.type == "cuda" else None)
    step = 0
    if state is not None:
        student.load_state_dict(state["student"], strict=False)
        opt.load_state_dict(state["optimizer"])
        step = int(state["step"])
    total = args.steps  # the schedule reads it late: a time limit shortens it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, total, args.schedule, args.warmup),
                                              last_epoch=step - 1)  # fmt: skip
    bar = tqdm(total=total, initial=step, unit="step", desc="distill", file=sys.stderr, disable=args.quiet)
    stats: dict = {}
    stop_at = args.stop_at or total
    train_start, first_step, sums, n_sums = time.time(), step, {}, 0
    matmul_precision = torch.get_float32_matmul_precision()
    if device.type == "cuda" and args.tf32:
        torch.set_float32_matmul_precision("high")  # TF32 tensor cores for the fp32 matmuls of training
    try:
        while step < min(total, stop_at):
            batch = tokenizer(sampler.batch(step), padding=True, truncation=True, max_length=args.seq_len,
                              return_tensors="pt").to(device)  # fmt: skip
            loss, stats = distill_loss(student, teacher, batch, pooling, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            lr, lr_scale = opt.param_groups[1]["lr"], opt.param_groups[0]["lr"]
            sched.step()
            step += 1
            stats["loss"] = loss.detach()
            bar.update(1)
            # Sums stay on the device: reading them back waits for the GPU, so it happens only every log_every steps.
            sums, n_sums = {k: sums.get(k, 0.0) + v for k, v in stats.items()}, n_sums + 1
            if args.time_limit is not None:
                total = _steps_that_fit(args, total, step, first_step, run_start, train_start)
                bar.total = total
            last = step == min(total, stop_at)
            if step % args.save_every == 0 or last:
                _save_state(state_path, step, opt, student, {n for n, _ in params}, bits, args.scales, args.skip)
            if step % args.log_every == 0 or last:
                means = {k: float(v) / n_sums for k, v in sums.items()}
                bar.set_postfix({k: f"{v:.4f}" for k, v in means.items()}, refresh=False)
                if args.log:
                    _log(args.log, {"step": step, "lr": lr, "lr_scale": lr_scale,
                                    "seconds": round(time.time() - run_start, 2), **means})  # fmt: skip
                sums, n_sums = {}, 0
            if args.export_every and step % args.export_every == 0 and step < total:
                # A checkpoint of the run so far, to evaluate while training goes on.
                export(base, f"{str(dst).rstrip('/')}.step{step}", student, layers, list(dense), progress=False,
                       overwrite=True, activation_bits=bits)  # fmt: skip
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
    stats = {k: float(v) for k, v in stats.items()}
    bar.close()
    timing = {"seconds": time.time() - t0, "train_seconds": time.time() - train_start}
    if args.time_limit is not None:
        timing["time_limited"] = total < args.steps
    if step < total:
        return {"steps": step, **timing, "stopped": True, "state": str(state_path), **stats}
    student.eval()
    export(base, dst, student.cpu(), layers, list(dense), progress=not args.quiet, overwrite=args.overwrite,
           activation_bits=bits)
    if not args.keep_state:
        state_path.unlink(missing_ok=True)
    out = {"steps": step, **timing, "state": str(state_path) if args.keep_state else None, **stats}
    if args.log:
        _log(args.log, {"done": True, "seconds_with_export": round(time.time() - run_start, 2), **out})
    return out


def _steps_that_fit(args: DistillConfig, total: int, step: int, first: int, run_start: float, train_start: float) -> int:
    """The schedule's length under ``time_limit``: now, once time is up; re-estimated every ``save_every`` steps."""
    now = time.time()
    left = args.time_limit - (now - run_start)
    if left <= 0:
        return step
    if step % args.save_every:
        return total
    per_step = (now - train_start) / max(1, step - first)
    return min(args.steps, step + int(left / per_step))


def _log(path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")

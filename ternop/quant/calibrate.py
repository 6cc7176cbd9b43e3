"""Calibrated ternarization: codes and scales that minimise each layer's *output* error.

Rounding each weight block to its L2-nearest ternary form (``ternop.quantize``) treats all input
dimensions alike; real activations are not alike, so the output error is far larger than the
weight error suggests. Here each linear layer ``y = x W^T`` gets the ternary ``Q`` (codes T, fp16
scales per 128-block along K) that minimises, over calibration tokens,

    || X_q Q^T - X_fp W^T ||^2  =  tr((Q - W~) H (Q - W~)^T) + const,
    H = X_q^T X_q (+ damping),   W~ = W (X_fp^T X_q) H^-1,

where X_fp is the layer's input in the fp model and X_q its input once the layers before it are
ternary. Layers are processed in execution order, so each one also corrects the error the
earlier ones introduced (``target="fp"``; ``target="quantized"`` is plain GPTQ's objective).

For one layer the minimisation alternates two exact-ish steps (``rounds`` times):

1. **Codes, with error feedback (GPTQ adapted to ternary).** Columns are visited in order; each
   weight is rounded to {-s, 0, +s} of its block's scale s, and its rounding error is spread onto
   the columns not yet rounded through the inverse Hessian (the OBS update), so later columns
   compensate. In the first round a block's scales come from the L2-optimal ternarization of
   the block's *updated* weights, just before it is rounded.
2. **Scales, jointly.** With the codes fixed, the loss is quadratic in a row's K/128 scales:
   ``A s = c`` with ``A[b, c] = T_b H_bc T_c^T`` and ``c_b = T_b (H W~^T)_b``, solved per row.

The best candidate by the layer loss is kept, the optimal-rounding codes included, so the
result is never worse than ``optimal`` on the calibration objective.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch
from torch import nn

from ternop.format import BLOCK_SIZE, SCALE_DTYPE, pack_codes, values_to_codes
from ternop.quant.replay import BlockReplay, capture_inputs, find_blocks, real_tokens, run_batches
from ternop.quantize import quantize_to_values
from ternop.selection import select_linears


def _layer_loss(w_target: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = q - w_target
    return float(((d @ h) * d).sum())


def _dequant(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.to(scale.dtype) * scale.repeat_interleave(BLOCK_SIZE, dim=1)


def _refit_scales(w: torch.Tensor, values: torch.Tensor, h: torch.Tensor, ridge: float) -> torch.Tensor:
    """Least-squares per-block scales [N, K/128] for fixed codes ``values`` [N, K] under metric ``h``."""
    n, k = w.shape
    nb = k // BLOCK_SIZE
    t = values.to(w.dtype)
    wh = w @ h  # [N, K]
    c = (t * wh).reshape(n, nb, BLOCK_SIZE).sum(-1)
    a = torch.empty(n, nb, nb, dtype=w.dtype, device=w.device)
    for j in range(nb):
        cols = slice(j * BLOCK_SIZE, (j + 1) * BLOCK_SIZE)
        y = t[:, cols] @ h[:, cols].T  # [N, K]: sum_l T[n, l] H[k, l] over block j
        a[:, :, j] = (t * y).reshape(n, nb, BLOCK_SIZE).sum(-1)
    diag = a.diagonal(dim1=1, dim2=2)
    eye = torch.eye(nb, dtype=w.dtype, device=w.device)
    # An all-zero block has a zero row in A: the ridge makes its scale 0 instead of singular.
    a = a + eye * (ridge * diag.mean(-1, keepdim=True).clamp(min=1e-12)[:, :, None] + 1e-12)
    return torch.linalg.solve(a, c.unsqueeze(-1)).squeeze(-1)


def _gptq_codes(
    w: torch.Tensor, hinv_u: torch.Tensor, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One error-feedback pass. ``hinv_u`` is the upper Cholesky factor of H^-1.

    If ``scale`` [N, K/128] is None, each block's scales are the L2-optimal ones of its updated weights.
    Returns (values int8 [N, K], scale fp32 [N, K/128]).
    """
    # Hundreds of tiny ops per block: worker threads only add synchronisation (10x slower on a busy CPU).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq_codes_impl(w, hinv_u, scale)
    finally:
        torch.set_num_threads(threads)


def _gptq_codes_impl(w, hinv_u, scale):
    w = w.clone()
    n, k = w.shape
    values = torch.zeros(n, k, dtype=torch.int8, device=w.device)
    scales = torch.zeros(n, k // BLOCK_SIZE, dtype=w.dtype, device=w.device)
    for j in range(k // BLOCK_SIZE):
        lo, hi = j * BLOCK_SIZE, (j + 1) * BLOCK_SIZE
        w1 = w[:, lo:hi].clone()
        if scale is None:
            _, s = quantize_to_values(w1, "optimal")
            s = s.to(w.dtype)[:, 0]
        else:
            s = scale[:, j]
        s = s.to(SCALE_DTYPE).to(w.dtype)  # round codes against the scale that will be stored
        safe = torch.where(s != 0, s, torch.ones_like(s))
        err1 = torch.zeros_like(w1)
        h1 = hinv_u[lo:hi, lo:hi]
        for i in range(BLOCK_SIZE):
            col = w1[:, i]
            t = torch.round(torch.clamp(col / safe, -1.0, 1.0))
            t = torch.where(s != 0, t, torch.zeros_like(t))
            err = (col - t * s) / h1[i, i]
            w1[:, i:] -= err[:, None] * h1[i, i:][None, :]
            err1[:, i] = err
            values[:, lo + i] = t.to(torch.int8)
        w[:, hi:] -= err1 @ hinv_u[lo:hi, hi:]
        scales[:, j] = s
    return values, scales


def ternarize_layer(
    w: torch.Tensor,
    h: torch.Tensor,
    cross: torch.Tensor | None = None,
    *,
    rounds: int = 2,
    damp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Calibrated ternarization of one layer.

    ``w`` [N, K] float; ``h`` [K, K] = X_q^T X_q; ``cross`` [K, K] = X_fp^T X_q or None (then the
    target is ``w`` itself). Returns (values int8 [N, K] in {-1,0,1}, scale fp16 [N, K/128], info)
    where info holds the layer losses of the optimal-rounding baseline and of the result.
    """
    n, k = w.shape
    if h.shape != (k, k):
        raise ValueError(f"h must be [K, K] = [{k}, {k}] for weight {tuple(w.shape)}, got {tuple(h.shape)}")
    # Factorisations in fp64 (H is ill-conditioned); the O(N K^2) products in fp32.
    w = w.detach().float()
    h64 = h.detach().to(torch.float64).clone()
    dead = torch.diagonal(h64) <= 0
    h64[dead, dead] = 1.0  # inputs that never fire: any code is as good; keep H invertible
    h64 += torch.eye(k, dtype=h64.dtype, device=h64.device) * (damp * torch.diagonal(h64).mean())
    hinv64 = torch.cholesky_inverse(torch.linalg.cholesky(h64))
    h, hinv = h64.float(), hinv64.float()
    target = w if cross is None else (w @ cross.float()) @ hinv
    hinv_u = torch.linalg.cholesky(hinv64, upper=True).float()

    v0, s0 = quantize_to_values(w.float(), "optimal")
    candidates = [(v0, s0.float())]
    candidates.append((v0, _refit_scales(target, v0, h, 1e-6)))
    scale = None
    for _ in range(rounds):
        v, s = _gptq_codes(target, hinv_u, scale)
        candidates.append((v, s))
        scale = _refit_scales(target, v, h, 1e-6)
        candidates.append((v, scale))
    losses = [_layer_loss(target, _dequant(v, s.to(SCALE_DTYPE).float()), h) for v, s in candidates]
    best = min(range(len(candidates)), key=losses.__getitem__)
    values, scale = candidates[best]
    # A negative least-squares scale is legal but unusual: store it positive, flip the codes.
    neg = (scale < 0).repeat_interleave(BLOCK_SIZE, dim=1)
    values = torch.where(neg, -values, values)
    scale = scale.abs().to(SCALE_DTYPE)
    info = {"loss_optimal": losses[0], "loss": losses[best], "candidate": best}
    return values, scale, info


# --------------------------------------------------------------------------- whole models


def _batches(tokenizer, texts, seq_len: int, max_tokens: int, batch_size: int):
    """Tokenised batches (dicts of tensors) holding at most ``max_tokens`` real tokens."""
    out, total = [], 0
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(list(texts[i : i + batch_size]), padding=True, truncation=True,
                        max_length=seq_len, return_tensors="pt")  # fmt: skip
        out.append(enc)
        total += int(enc["attention_mask"].sum())
        if total >= max_tokens:
            break
    return out


def _groups(model, linears: dict[str, nn.Linear], batch) -> list[list[str]]:
    """Target linears in execution order, grouped by shared input tensor (q/k/v read the same x).

    Inputs are told apart by address and version counter while every input is held: a freed
    input's address can come back for the next layer's (the CUDA caching allocator hands it out at
    once), and an input changed in place keeps its address. Either way the two layers would share
    one Hessian that belongs to neither.
    """
    order, seen_input, held = [], {}, []
    handles = []
    for name, module in linears.items():

        def hook(mod, args, name=name):
            if name not in seen_input:
                held.append(args[0])
                seen_input[name] = (args[0].data_ptr(), args[0]._version, tuple(args[0].shape))
                order.append(name)

        handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    held.clear()
    groups: list[list[str]] = []
    for name in order:
        if groups and seen_input[groups[-1][0]] == seen_input[name]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def _capture(model, module: nn.Module, batches) -> list[torch.Tensor]:
    """Inputs of ``module`` for each batch, real tokens only: list of [tokens, K] fp32 (the model
    run up to the module's first call)."""
    return capture_inputs(module, [(batch["attention_mask"], partial(model, **batch)) for batch in batches])


def _capture_first_calls(model, modules: dict[str, nn.Module], batches, step=None) -> dict[str, list[torch.Tensor]]:
    """Inputs of every module in ``modules`` for each batch, from one pass of the model a batch:
    name -> list of [tokens, K] fp16, real tokens only. As ``_capture`` (which stops the model at
    its one module), a module's first call in a pass counts; each input is copied when the module
    reads it, so that a later in-place change of that tensor does not reach the copy. ``step()``,
    if given, is called after each batch."""
    out: dict[str, list[torch.Tensor]] = {name: [] for name in modules}
    seen: set[str] = set()
    mask_box = {}
    handles = []
    for name, module in modules.items():

        def hook(mod, args, name=name):
            if name in seen:
                return
            seen.add(name)
            out[name].append(real_tokens(args[0].detach(), mask_box["m"]).to(torch.float16, copy=True))

        handles.append(module.register_forward_pre_hook(hook))

    def before(b, batch):
        mask_box["m"] = batch["attention_mask"]
        seen.clear()

    run_batches(model, batches, handles, before, step)
    return out


CALIB_TOKENS = 8192
"""Calibration tokens by default. The fp inputs of every layer group are kept (fp16) for the whole
model at once: tokens x the summed K of the groups x 2 bytes, about 3.3 GB for a Qwen3-0.6B-sized
model at this count (28 layers x K 1024 + 2048 + 1024 + 3072), 4x as much at 32768; 1.1 GB for
all-MiniLM-L6-v2 at 32768 (6 x 384 + 384 + 384 + 1536)."""


@torch.no_grad()
def calibrate_model(
    model: nn.Module,
    tokenizer,
    texts: list[str],
    skip=(),
    *,
    max_tokens: int = CALIB_TOKENS,
    seq_len: int = 128,
    batch_size: int = 16,
    rounds: int = 2,
    damp: float = 0.01,
    target: str = "fp",
    progress: bool = True,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Ternarizes, in place and in execution order, every linear chosen by ``ternop.selection``.

    Each chosen layer's ``weight`` is replaced by its dequantized ternary weight (so later layers
    see ternary inputs). Returns name -> (values int8 [N, K], scale fp16 [N, K/128]).
    """
    if target not in ("fp", "quantized"):
        raise ValueError(f"target must be 'fp' or 'quantized', got {target!r}")
    if not texts:
        raise ValueError("calibration needs at least one text")
    model.eval()
    linears, _ = select_linears(model, skip)
    # The model's device runs the captures and the factorisations (a GPU when the model is on one).
    device = next(model.parameters()).device
    batches = [b.to(device) for b in _batches(tokenizer, texts, seq_len, max_tokens, batch_size)]
    groups = _groups(model, linears, batches[0])
    found = find_blocks(model, [linears[group[0]] for group in groups])
    passes = (target == "fp") + (found is not None)
    record = _bar(passes * len(batches), progress and passes > 0, unit="batch", desc="record")
    fp_inputs = {}
    if target == "fp":
        # One pass of the fp model a batch stores every group's input (fp16 to halve the memory).
        fp_inputs = _capture_first_calls(model, {group[0]: linears[group[0]] for group in groups}, batches,
                                         step=record.update)  # fmt: skip
    # Each group's input with the layers before it ternary: from the group's block alone where the
    # model replays block by block exactly (ternop.quant.replay), else from a pass up to the group.
    replay = BlockReplay.build(model, found[0], batches, step=record.update) if found is not None else None
    record.close()
    results = {}
    bar = _bar(sum(len(g) for g in groups), progress)
    for index, group in enumerate(groups):
        if replay is not None:
            while replay.current < found[1][index]:
                replay.advance()
            xq = torch.cat(replay.capture(linears[group[0]]))
        else:
            xq = torch.cat(_capture(model, linears[group[0]], batches))
        h = xq.T @ xq
        cross = None
        if target == "fp":
            xf = torch.cat(fp_inputs.pop(group[0])).float()
            cross = xf.T @ xq
            del xf
        del xq
        for name in group:
            layer = linears[name]
            values, scale, info = ternarize_layer(layer.weight, h, cross, rounds=rounds, damp=damp)
            layer.weight.copy_(_dequant(values, scale.float()).to(layer.weight.dtype))
            results[name] = (values, scale)
            bar.update(1)
            bar.set_postfix_str(f"{name} loss {info['loss'] / max(info['loss_optimal'], 1e-30):.3f}x optimal")
    bar.close()
    return results


def read_calibration_text(path: str) -> list[str]:
    """One text per non-empty line of a UTF-8 file; ValueError naming the file if it is missing or empty."""
    if not os.path.isfile(path):
        raise ValueError(f"calibration file {path!r} does not exist or is not a file")
    with open(path, encoding="utf-8", errors="replace") as f:
        texts = [line.strip() for line in f if line.strip()]
    if not texts:
        raise ValueError(f"calibration file {path!r} holds no text")
    return texts


def to_packed(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 [N, K], scale fp16 [N, K/128]) -> (weight_packed uint8 [N, K/4], weight_scale fp16)."""
    return pack_codes(values_to_codes(values)), scale.to(SCALE_DTYPE).contiguous()


def _bar(total: int, enabled: bool, unit: str = "layer", desc: str = "calibrate"):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, disable=not enabled)

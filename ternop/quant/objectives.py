"""What ``ternop distill`` minimises: the student's embeddings against the teacher's, as embeddings are used.

Three terms, each weighted by :class:`Weights` (0 turns a term off):

``cos``      ``1 - cos`` between the student's and the teacher's pooled, normalised embedding of each text;
``rel``      in-batch relational distillation: the teacher's similarity matrix over the batch is the
             target. ``rel_temp > 0``: KL divergence from the teacher's row-wise softmax of
             ``cos / rel_temp`` to the student's (the diagonal left out); ``rel_temp = 0``: the mean
             squared difference of the off-diagonal cosines;
``hidden``   the mean squared difference of hidden states on real tokens, divided by the teacher's mean
             square: the last layer (``hidden_layers="last"``) or the mean over every layer's output
             (``"all"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Weights:
    cos: float = 1.0
    rel: float = 0.0
    rel_temp: float = 0.05
    hidden: float = 1.0
    hidden_layers: str = "last"

    def __post_init__(self):
        if self.hidden_layers not in ("last", "all"):
            raise ValueError(f"hidden_layers must be 'last' or 'all', got {self.hidden_layers!r}")
        if min(self.cos, self.rel, self.hidden, self.rel_temp) < 0:
            raise ValueError(f"loss weights and rel_temp must be >= 0, got {self}")


def relational(se: torch.Tensor, te: torch.Tensor, temp: float) -> torch.Tensor:
    """se, te ``[B, D]`` normalised -> scalar: how far the student's in-batch similarities are from the teacher's."""
    b = se.shape[0]
    if b < 2:
        return se.new_zeros(())
    off = ~torch.eye(b, dtype=torch.bool, device=se.device)
    s, t = (se @ se.T)[off].view(b, b - 1), (te @ te.T)[off].view(b, b - 1)
    if temp == 0:
        return ((s - t) ** 2).mean()
    p = torch.softmax(t / temp, dim=-1)
    return (p * (torch.log_softmax(t / temp, dim=-1) - torch.log_softmax(s / temp, dim=-1))).sum(-1).mean()


def _hidden_mse(sh: torch.Tensor, th: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((sh - th)[mask] ** 2).mean() / (th[mask] ** 2).mean().clamp(min=1e-12)


def distill_loss(student, teacher, batch, pooling: str, w: Weights) -> tuple[torch.Tensor, dict]:
    """The weighted loss of one batch (a tokenizer's dict of tensors) and its parts, detached 0-d tensors.

    The parts stay tensors so that a training loop on a GPU reads them back (a host sync) only
    when it logs, not at every step.
    """
    from ternop.hf.embedding import pool

    all_layers = w.hidden > 0 and w.hidden_layers == "all"
    with torch.no_grad():
        tout = teacher(**batch, output_hidden_states=all_layers)
        th = tout.last_hidden_state.float()
        te = pool(th, batch["attention_mask"], pooling)
    sout = student(**batch, output_hidden_states=all_layers)
    sh = sout.last_hidden_state.float()
    se = pool(sh, batch["attention_mask"], pooling)
    cos = (se * te).sum(-1)
    stats = {"cos": cos.detach().mean()}
    loss = w.cos * (1.0 - cos).mean()
    if w.rel > 0:
        rel = relational(se, te, w.rel_temp)
        loss = loss + w.rel * rel
        stats["rel"] = rel.detach()
    if w.hidden > 0:
        m = batch["attention_mask"].bool()
        if all_layers:
            # hidden_states[0] is the embedding output, identical in both: the layers' outputs follow it.
            pairs = list(zip(sout.hidden_states[1:], tout.hidden_states[1:]))
            mse = sum(_hidden_mse(s.float(), t.float(), m) for s, t in pairs) / len(pairs)
        else:
            mse = _hidden_mse(sh, th, m)
        loss = loss + w.hidden * mse
        stats["hmse"] = mse.detach()
    return loss, stats

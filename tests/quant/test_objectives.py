"""The distillation objectives: cosine, in-batch relational, hidden states."""

from __future__ import annotations

import pytest
import torch

from ternop.quant import objectives


def _unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


@pytest.mark.parametrize("temp", [0.0, 0.05])
def test_relational_is_zero_on_the_teacher_and_grows_with_distortion(temp):
    torch.manual_seed(0)
    te = _unit(torch.randn(8, 32))
    assert float(objectives.relational(te.clone(), te, temp)) == pytest.approx(0.0, abs=1e-6)
    small = objectives.relational(_unit(te + 0.05 * torch.randn(8, 32)), te, temp)
    large = objectives.relational(_unit(te + 0.5 * torch.randn(8, 32)), te, temp)
    assert 0 < float(small) < float(large)


def test_relational_sees_structure_that_cosine_does_not():
    # A rotation keeps every in-batch similarity: relational 0, cosine to the teacher far from 1.
    torch.manual_seed(1)
    te = _unit(torch.randn(6, 16))
    q, _ = torch.linalg.qr(torch.randn(16, 16))
    se = te @ q
    assert float((se * te).sum(-1).mean()) < 0.5
    assert float(objectives.relational(se, te, 0.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(objectives.relational(se[:1], te[:1], 0.05)) == 0.0  # one text: no pairs


class _Toy(torch.nn.Module):
    """Two linear 'layers' with a HF-like output (last_hidden_state, hidden_states)."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(16, 16, generator=g) / 4)
        self.b = torch.nn.Parameter(torch.randn(16, 16, generator=g) / 4)

    def forward(self, input_ids, attention_mask, output_hidden_states=False):
        from types import SimpleNamespace

        x = torch.nn.functional.one_hot(input_ids, 16).float()
        h1 = torch.tanh(x @ self.a)
        h2 = h1 @ self.b
        return SimpleNamespace(last_hidden_state=h2, hidden_states=(x, h1, h2) if output_hidden_states else None)


def test_distill_loss_terms_and_weights():
    teacher, student = _Toy(0), _Toy(1)
    batch = {"input_ids": torch.randint(16, (4, 5), generator=torch.Generator().manual_seed(2)),
             "attention_mask": torch.ones(4, 5, dtype=torch.long)}  # fmt: skip
    batch["attention_mask"][0, 3:] = 0
    w = objectives.Weights(cos=1.0, rel=0.5, hidden=2.0, hidden_layers="all")
    loss, stats = objectives.distill_loss(student, teacher, batch, "mean", w)
    assert set(stats) == {"cos", "rel", "hmse"}
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())  # read back only when logged
    want = (1 - float(stats["cos"])) + 0.5 * float(stats["rel"]) + 2.0 * float(stats["hmse"])
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    loss.backward()
    assert student.a.grad is not None and float(student.a.grad.abs().sum()) > 0
    _, s_all = objectives.distill_loss(student, teacher, batch, "mean", objectives.Weights(hidden_layers="all"))
    _, s_last = objectives.distill_loss(student, teacher, batch, "mean", objectives.Weights(hidden_layers="last"))
    assert float(s_all["hmse"]) != pytest.approx(float(s_last["hmse"]))  # "all" also matches the first layer
    same, s = objectives.distill_loss(teacher, teacher, batch, "mean", w)
    assert float(same.detach()) == pytest.approx(0.0, abs=1e-5) and float(s["cos"]) == pytest.approx(1.0)


def test_weights_are_checked():
    with pytest.raises(ValueError, match="hidden_layers must be"):
        objectives.Weights(hidden_layers="first")
    with pytest.raises(ValueError, match=">= 0"):
        objectives.Weights(rel=-1.0)

"""Gate-driven mixed precision: the fewest dense layers, chosen by measured sensitivity, that meet the bound."""

from __future__ import annotations

import pytest
import torch

from ternop.quant.mixed import choose_dense


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(4, 4, bias=False) for _ in range(4)))


# Each layer's damage when ternary; the "metric" is 1 - the summed damage (MRR-like), "smooth" ranks.
DAMAGE = {"0": 0.01, "1": 0.20, "2": 0.05, "3": 0.10}


def _measure_of(model, ternary):
    def measure(m):
        lost = sum(d for name, d in DAMAGE.items() if torch.equal(m.get_submodule(name).weight, ternary[name]))
        return {"mrr": 1.0 - lost, "smooth": 1.0 - lost}

    return measure


def test_chooses_the_fewest_most_sensitive_layers_and_restores_weights():
    model = _model()
    dense = {n: model.get_submodule(n).weight.detach().clone() for n in DAMAGE}
    ternary = {n: torch.sign(w) for n, w in dense.items()}
    choice = choose_dense(model, ternary, _measure_of(model, ternary), max_loss=0.07, metric="mrr", rank_by="smooth")
    # All ternary loses 0.36; keeping "1" (0.20) and "3" (0.10) dense leaves 0.06 <= 0.07.
    assert choice.dense == ["1", "3"] and choice.met
    assert [n for n, _ in choice.ranking] == ["1", "3", "2", "0"]
    assert choice.base["mrr"] == 1.0 and choice.all_ternary["mrr"] == pytest.approx(0.64)
    assert choice.final["mrr"] == pytest.approx(0.94) and [k for k, _ in choice.trials] == [1, 2]
    for n, w in dense.items():
        assert torch.equal(model.get_submodule(n).weight, w), n


def test_no_layer_when_all_ternary_meets_the_bound_and_every_layer_for_no_loss():
    model = _model()
    ternary = {n: torch.sign(model.get_submodule(n).weight.detach()) for n in DAMAGE}
    measure = _measure_of(model, ternary)
    none = choose_dense(model, ternary, measure, max_loss=0.5, metric="mrr", rank_by="smooth")
    assert none.dense == [] and none.met and none.ranking == []  # nothing measured beyond the two ends
    every = choose_dense(model, ternary, measure, max_loss=0.0, metric="mrr", rank_by="smooth")
    assert every.dense == ["1", "3", "2", "0"] and every.met and every.final["mrr"] == 1.0


def test_bad_input_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="max_loss must be >= 0"):
        choose_dense(model, {}, lambda m: {}, max_loss=-0.1)
    with pytest.raises(ValueError, match=r"ternary weight \[2, 2\] != dense \[4, 4\]"):
        choose_dense(model, {"0": torch.zeros(2, 2)}, lambda m: {}, max_loss=0.1)


def test_a_byte_budget_ranks_by_gain_per_byte_and_passes_over_what_does_not_fit():
    model = _model()
    ternary = {n: torch.sign(model.get_submodule(n).weight.detach()) for n in DAMAGE}
    # Gain per byte: "2" 0.05, "3" 0.025, "1" 0.02, "0" 0.01; "1" (10 bytes) overruns a 6-byte budget.
    cost = {"0": 1, "1": 10, "2": 1, "3": 4}
    choice = choose_dense(model, ternary, _measure_of(model, ternary), max_loss=0.0, metric="mrr", rank_by="smooth",
                          cost=cost, budget=6)  # fmt: skip
    assert [n for n, _ in choice.ranking] == ["2", "3", "1", "0"]
    assert choice.dense == ["2", "3", "0"] and not choice.met
    assert choice.final["mrr"] == pytest.approx(0.8)  # "1" stays ternary
    # A budget that fits all of them ends where the bound is met, as without one.
    roomy = choose_dense(model, ternary, _measure_of(model, ternary), max_loss=0.21, metric="mrr", rank_by="smooth",
                         cost=cost, budget=100)  # fmt: skip
    assert roomy.dense == ["2", "3"] and roomy.met and roomy.final["mrr"] == pytest.approx(0.79)


def test_a_budget_is_checked():
    model = _model()
    ternary = {n: torch.sign(model.get_submodule(n).weight.detach()) for n in DAMAGE}
    with pytest.raises(ValueError, match="budget must be >= 0 bytes"):
        choose_dense(model, ternary, lambda m: {}, max_loss=0.1, cost={n: 1 for n in DAMAGE}, budget=-1)
    with pytest.raises(ValueError, match=r"none for \['3'\]"):
        choose_dense(model, ternary, lambda m: {}, max_loss=0.1, cost={"0": 1, "1": 1, "2": 1}, budget=5)


def test_fill_takes_the_layers_that_gain_nothing_too_while_they_fit(monkeypatch):
    monkeypatch.setitem(DAMAGE, "0", 0.0)  # dense or ternary, layer "0" measures the same
    model = _model()
    ternary = {n: torch.sign(model.get_submodule(n).weight.detach()) for n in DAMAGE}
    cost = {"0": 1, "1": 10, "2": 1, "3": 4}
    kw = dict(max_loss=0.0, metric="mrr", rank_by="smooth", cost=cost, budget=6)
    assert choose_dense(model, ternary, _measure_of(model, ternary), **kw).dense == ["2", "3"]
    filled = choose_dense(model, ternary, _measure_of(model, ternary), fill=True, **kw)
    assert filled.dense == ["2", "3", "0"] and not filled.met  # "1" still does not fit
    assert filled.final["mrr"] == pytest.approx(0.8)


def test_groups_are_ranked_costed_and_kept_as_one():
    model = _model()
    ternary = {n: torch.sign(model.get_submodule(n).weight.detach()) for n in DAMAGE}
    measure = _measure_of(model, ternary)
    # "1" (0.20) is grouped with "0" (0.01): the group gains 0.21, more than "3" (0.10) or "2" (0.05).
    choice = choose_dense(model, ternary, measure, max_loss=0.07, metric="mrr", rank_by="smooth",
                          groups=[["1", "0"], ["2"], ["3"]])  # fmt: skip
    assert [u for u, _ in choice.ranking] == ["1 + 0", "3", "2"]
    assert choice.dense == ["1", "0", "3"] and choice.met and choice.final["mrr"] == pytest.approx(0.95)
    assert choice.trials == [(2, pytest.approx(0.85)), (3, pytest.approx(0.95))]  # counts of layers dense
    # With a budget a group costs its layers' bytes together: 10 + 1 overruns 10, so "3" and "2" go first.
    cost = {"0": 1, "1": 10, "2": 1, "3": 4}
    tight = choose_dense(model, ternary, measure, max_loss=0.0, metric="mrr", rank_by="smooth", cost=cost, budget=10,
                         groups=[["1", "0"], ["2"], ["3"]])  # fmt: skip
    assert tight.dense == ["2", "3"] and not tight.met
    with pytest.raises(ValueError, match=r"missing \['3'\], unknown \['4'\], twice \['0'\]"):
        choose_dense(model, ternary, measure, max_loss=0.0, groups=[["1", "0"], ["2", "0"], ["4"]])

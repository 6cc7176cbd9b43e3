"""Gate-driven mixed precision: the fewest linear layers to keep dense so that a measured loss is met.

``choose_dense`` works on an in-memory model whose chosen linears can take either their dense
weight or their ternary one (dequantized). A caller-supplied ``measure(model) -> {name: value}``
scores the model as it stands (``ternop quantize --keep-dense auto`` measures wiki-retrieval MRR
and the mean cosine to the fp embeddings, :mod:`ternop.cli.mixed`). Then:

1. the dense model and the all-ternary model are measured;
2. sensitivity: each layer alone is put back dense (every other layer ternary) and the gain in
   ``rank_by`` over the all-ternary model is its score (a smooth metric ranks better than MRR,
   which moves in steps of one query);
3. the most sensitive layers are made dense one at a time, in that order, until ``metric`` is at
   most ``max_loss`` below the dense model's. The gate is the measurement, not the ranking.

With a byte budget (``cost``: the bytes each layer adds when kept dense, ``budget``: the most
they may add up to), the ranking is by gain per byte, layers that gain nothing are left out, and
a layer that would overrun the budget is passed over for the next one that fits. With ``fill``
the layers that gain nothing stay in the order too, last, so the budget fills up: for a model
that is trained around its dense layers afterwards (``ternop distill --keep-dense auto``), where
a layer's gain before training is only an order and the budget is the bound.

With ``groups`` (each layer in exactly one; :func:`ternop.selection.fused_groups` gives the layers
a serving engine fuses, which must be all dense or all ternary) each group is ranked, costed and
kept as one unit; ``ranking`` then names a group by its layers joined with " + ".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class DenseChoice:
    """What :func:`choose_dense` measured and chose."""

    dense: list[str]
    met: bool
    metric: str
    max_loss: float
    base: dict[str, float]
    all_ternary: dict[str, float]
    final: dict[str, float]
    ranking: list[tuple[str, float]] = field(default_factory=list)
    trials: list[tuple[int, float]] = field(default_factory=list)


def choose_dense(model: nn.Module, ternary: dict[str, torch.Tensor], measure: Callable[[nn.Module], dict[str, float]],
                 *, max_loss: float, metric: str = "wiki_mrr", rank_by: str = "mean_cosine",
                 cost: dict[str, int] | None = None, budget: int | None = None, fill: bool = False,
                 groups: Sequence[Sequence[str]] | None = None,
                 progress: Callable[[str], None] | None = None) -> DenseChoice:  # fmt: skip
    """Chooses the layers of ``ternary`` (module name -> dequantized weight ``[N, K]``) to keep dense.

    The model's weights are restored to dense before returning. ``met`` is False when the bound is
    missed even with every layer dense (then ``dense`` lists every layer), or, with a budget, with
    every layer that fits it and gains (then ``dense`` lists those).
    """
    if max_loss < 0:
        raise ValueError(f"max_loss must be >= 0, got {max_loss}")
    if budget is not None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget}")
        lacking = sorted(set(ternary) - set(cost or {}))
        if lacking:
            raise ValueError(f"a budget needs the cost of every layer; none for {lacking}")
    say = progress or (lambda msg: None)
    layers = {name: model.get_submodule(name) for name in ternary}
    dense_w = {name: layer.weight.data for name, layer in layers.items()}
    for name, w in ternary.items():
        if tuple(w.shape) != tuple(dense_w[name].shape):
            raise ValueError(f"{name}: ternary weight {list(w.shape)} != dense {list(dense_w[name].shape)}")
    tern_w = {name: w.to(dense_w[name].dtype) for name, w in ternary.items()}
    units = _units(list(ternary), groups)
    unit_cost = {u: sum(cost[n] for n in members) for u, members in units.items()} if budget is not None else {}

    def use(dense_units) -> dict[str, float]:
        dense = {n for u in dense_units for n in units[u]}
        for name, layer in layers.items():
            layer.weight.data = dense_w[name] if name in dense else tern_w[name]
        return measure(model)

    try:
        base = use(units)
        full = use(())
        bound = base[metric] - max_loss
        say(f"dense {metric} {base[metric]:.4f}, all ternary {full[metric]:.4f}; bound {bound:.4f}")
        if full[metric] >= bound:
            return DenseChoice([], True, metric, max_loss, base, full, full)
        ranking = []
        for i, unit in enumerate(units):
            gain = use((unit,))[rank_by] - full[rank_by]
            ranking.append((unit, gain))
            say(f"sensitivity {i + 1}/{len(units)}: {unit} dense -> {rank_by} {gain:+.4f}")
        if budget is None:
            ranking.sort(key=lambda x: -x[1])
            order = [unit for unit, _ in ranking]
        else:
            ranking.sort(key=lambda x: -x[1] / max(unit_cost[x[0]], 1))
            order = [unit for unit, gain in ranking if gain > 0 or fill]
        trials, chosen, final, spent = [], [], full, 0
        for unit in order:
            if budget is not None:
                if spent + unit_cost[unit] > budget:
                    say(f"{unit}: {unit_cost[unit]} bytes would overrun the budget ({spent} of {budget} spent); "
                        "passed over")  # fmt: skip
                    continue
                spent += unit_cost[unit]
            chosen.append(unit)
            final = use(chosen)
            dense = [n for u in chosen for n in units[u]]
            trials.append((len(dense), final[metric]))
            say(f"{len(dense)} dense: {metric} {final[metric]:.4f}")
            if final[metric] >= bound:
                break
        dense = [n for u in chosen for n in units[u]]
        return DenseChoice(dense, final[metric] >= bound, metric, max_loss, base, full, final, ranking, trials)
    finally:
        for name, layer in layers.items():
            layer.weight.data = dense_w[name]


def _units(names: list[str], groups) -> dict[str, list[str]]:
    """label -> layers: each group of ``groups`` (default: each layer alone), labelled by its layers joined."""
    if groups is None:
        return {name: [name] for name in names}
    flat = [n for g in groups for n in g]
    missing, unknown = sorted(set(names) - set(flat)), sorted(set(flat) - set(names))
    twice = sorted({n for n in flat if flat.count(n) > 1})
    if missing or unknown or twice:
        raise ValueError(f"groups must hold every layer exactly once: missing {missing}, unknown {unknown}, "
                         f"twice {twice}")  # fmt: skip
    return {" + ".join(g): list(g) for g in groups}

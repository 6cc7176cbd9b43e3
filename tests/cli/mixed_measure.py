"""A keep-dense measurement the tests control, for ``--keep-dense auto`` of ternop quantize and ternop distill.

Patched over ``ternop.cli.mixed._measure_fn``: the model scores 0.9 wiki MRR (cosine 1) less the
cost of each SENSITIVE layer whose weight differs from the dense model's, the model it sees first.
"""

from __future__ import annotations

import torch

# Two layers whose ternary form costs 0.1 MRR each, one that costs 0.001; every other layer costs nothing.
SENSITIVE = {"encoder.layer.0.attention.self.query": 0.1, "encoder.layer.1.output.dense": 0.1,
             "encoder.layer.1.intermediate.dense": 0.001}  # fmt: skip


# Layer 0's attention projections, which vLLM fuses: keep-dense auto keeps them dense together.
QKV0 = [f"encoder.layer.0.attention.self.{p}" for p in ("key", "query", "value")]


def fake_measure_fn(tokenizer, pooling, max_len):
    dense = {}

    def measure(model):
        if not dense:  # the first call sees the dense model
            dense.update({n: model.get_submodule(n).weight.detach().clone() for n in SENSITIVE})
        lost = sum(c for n, c in SENSITIVE.items() if not torch.equal(model.get_submodule(n).weight, dense[n]))
        return {"wiki_mrr": 0.9 - lost, "mean_cosine": 1.0 - lost}

    return measure


def dense_layers(path) -> list[str]:
    """The encoder layers a checkpoint leaves dense (its ``modules_to_not_convert``)."""
    from ternop.checkpoint import read_quant_config

    return [m for m in read_quant_config(path)["modules_to_not_convert"] if m.startswith("encoder.")]

"""``ternop quantize --keep-dense auto``: measure, then keep the fewest layers dense (:mod:`ternop.quant.mixed`).

The measurement is the eval gate's: wiki-retrieval MRR of the visible set (:mod:`ternop.cli.evaldata`)
through transformers, with the mean cosine to the fp model's embeddings of the same texts for
ranking. The held-out split is never used here, so it stays a fair test of the choice.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ternop.format import BLOCK_SIZE, packed_bytes


def _measure_fn(tokenizer, pooling: str, max_len: int):
    from ternop.cli import evaldata
    from ternop.hf.embedding import embed_model

    queries, docs = evaldata.wiki_retrieval()
    texts = queries + docs
    ref: list[torch.Tensor] = []

    def measure(model) -> dict[str, float]:
        emb = embed_model(model, tokenizer, texts, pooling, 32, max_len)
        if not ref:  # the first call is the dense model: its embeddings are the cosine reference
            ref.append(emb)
        m = evaldata.retrieval_metrics(emb[: len(queries)], emb[len(queries) :])
        return {"wiki_mrr": m["mrr"], "mean_cosine": float((emb * ref[0]).sum(-1).mean())}

    return measure


ALL_TERNARY_SHARE = packed_bytes(1, BLOCK_SIZE) / (2 * BLOCK_SIZE)  # 0.1328...: format v1's size against fp16


def choose(src, quantizer, skip, max_loss: float, progress: bool = True, size_budget: float | None = None):
    """(DenseChoice, checkpoint prefixes to keep dense) for the folder ``src`` and a ``Quantizer``.

    ``size_budget`` (a share, e.g. 0.25): the layers that would be converted, dense ones counted
    in fp16, may take at most this share of their bytes in fp16.
    """
    from ternop.format import dequantize
    from ternop.hf import load_model, load_tokenizer, module_to_checkpoint, pooling_mode
    from ternop.hf.embedding import max_seq_length
    from ternop.hf.loading import is_causal_lm
    from ternop.quant.mixed import choose_dense
    from ternop.selection import select_linears

    if is_causal_lm(src):
        raise ValueError("--keep-dense auto measures retrieval MRR: it needs an embedding model, not a causal LM")
    model = load_model(src, causal=False).eval()
    targets, _ = select_linears(model, skip)
    names = module_to_checkpoint(model, [f"{n}.weight" for n in targets], _index(src))
    ternary = {}
    for name, layer in targets.items():
        prefix = names[f"{name}.weight"][: -len(".weight")]
        packed, scale = quantizer(prefix, layer.weight.detach())
        ternary[name] = dequantize(packed, scale).float()
    say = (lambda msg: print(f"[keep-dense] {msg}", file=sys.stderr, flush=True)) if progress else None
    cost = budget = None
    if size_budget is not None:
        tern = {name: packed_bytes(*w.shape) for name, w in ternary.items()}
        cost = {name: 2 * w.numel() - tern[name] for name, w in ternary.items()}
        budget = int(size_budget * 2 * sum(w.numel() for w in ternary.values())) - sum(tern.values())
    measure = _measure_fn(load_tokenizer(src), pooling_mode(src), max_seq_length(src))
    with torch.no_grad():
        choice = choose_dense(model, ternary, measure, max_loss=max_loss, cost=cost, budget=budget, progress=say)
    return choice, [names[f"{n}.weight"][: -len(".weight")] for n in choice.dense]


def _index(src):
    from ternop.checkpoint import tensor_index

    return tensor_index(Path(src))


def dense_bytes(src, prefixes) -> dict[str, int]:
    """Bytes of the layers ``prefixes`` kept dense: as stored in ``src``, and in fp16."""
    from ternop.checkpoint.safetensors_io import element_size

    index = _index(src)
    stored = fp16 = 0
    for prefix in prefixes:
        info = index[f"{prefix}.weight"]
        n = 1
        for d in info.shape:
            n *= d
        stored += n * element_size(info.dtype)
        fp16 += n * 2
    return {"stored": stored, "fp16": fp16}

"""``--keep-dense auto``: measure, then keep the fewest layers dense (:mod:`ternop.quant.mixed`).

The measurement is the eval gate's: wiki-retrieval MRR of the visible set (:mod:`ternop.cli.evaldata`)
through transformers, with the mean cosine to the dense model's embeddings of the same texts for
ranking. The held-out split is never used here, so it stays a fair test of the choice.

Two questions, one chooser: :func:`choose` ranks the layers of an fp model against their rounding by
a quantizer (``ternop quantize --keep-dense auto``); :func:`choose_around` ranks them around a
ternary checkpoint of the model, an earlier distillation's output (``ternop distill --keep-dense
auto --rank-from CKPT``): the dense model is then the base with that checkpoint's trained biases
and norms, and each layer's ternary form is the checkpoint's codes.
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


def check_size_budget(size_budget: float | None) -> None:
    """ValueError unless ``size_budget`` is None or a share of fp16's bytes that all-ternary fits."""
    if size_budget is None:
        return
    if not 0 < size_budget <= 1:
        raise ValueError(f"--size-budget must be a share in (0, 1], got {size_budget}")
    if size_budget < ALL_TERNARY_SHARE:
        raise ValueError(f"--size-budget {size_budget} is below the all-ternary size, {ALL_TERNARY_SHARE:.3f} of fp16")


def _embedding_model(src):
    from ternop.hf import load_model
    from ternop.hf.loading import is_causal_lm

    if is_causal_lm(src):
        raise ValueError("--keep-dense auto measures retrieval MRR: it needs an embedding model, not a causal LM")
    return load_model(src, causal=False).eval()


def _choose(src, model, ternary: dict[str, torch.Tensor], max_loss: float, progress: bool, size_budget: float | None,
            fill: bool = False):  # fmt: skip
    """choose_dense over ``ternary`` (module name -> dequantized weight) on ``model``, measured with
    ``src``'s tokenizer and pooling; with a size budget, each layer costs its fp16 bytes less its ternary ones.
    The layers a serving engine fuses (q/k/v, gate/up) are kept dense or ternary together, so that
    vLLM can load the checkpoint."""
    from ternop.hf import load_tokenizer, pooling_mode
    from ternop.hf.embedding import max_seq_length
    from ternop.quant.mixed import choose_dense
    from ternop.selection import fused_groups

    say = (lambda msg: print(f"[keep-dense] {msg}", file=sys.stderr, flush=True)) if progress else None
    cost = budget = None
    if size_budget is not None:
        tern = {name: packed_bytes(*w.shape) for name, w in ternary.items()}
        cost = {name: 2 * w.numel() - tern[name] for name, w in ternary.items()}
        budget = int(size_budget * 2 * sum(w.numel() for w in ternary.values())) - sum(tern.values())
    measure = _measure_fn(load_tokenizer(src), pooling_mode(src), max_seq_length(src))
    with torch.no_grad():
        return choose_dense(model, ternary, measure, max_loss=max_loss, cost=cost, budget=budget, fill=fill,
                            groups=fused_groups(ternary), progress=say)  # fmt: skip


def choose(src, quantizer, skip, max_loss: float, progress: bool = True, size_budget: float | None = None):
    """(DenseChoice, checkpoint prefixes to keep dense) for the folder ``src`` and a ``Quantizer``.

    ``size_budget`` (a share, e.g. 0.25): the layers that would be converted, dense ones counted
    in fp16, may take at most this share of their bytes in fp16.
    """
    from ternop.format import dequantize
    from ternop.hf import module_to_checkpoint
    from ternop.selection import select_linears

    model = _embedding_model(src)
    targets, _ = select_linears(model, skip)
    names = module_to_checkpoint(model, [f"{n}.weight" for n in targets], _index(src))
    ternary = {}
    for name, layer in targets.items():
        prefix = names[f"{name}.weight"][: -len(".weight")]
        packed, scale = quantizer(prefix, layer.weight.detach())
        ternary[name] = dequantize(packed, scale).float()
    choice = _choose(src, model, ternary, max_loss, progress, size_budget)
    return choice, [names[f"{n}.weight"][: -len(".weight")] for n in choice.dense]


def choose_around(base, ckpt, skip, max_loss: float, progress: bool = True, size_budget: float | None = None):
    """(DenseChoice, module name -> (N, K) of the ranked layers) around the ternary checkpoint ``ckpt``;
    ``choice.dense`` holds module names of ``base``'s model.

    ``ckpt`` must make exactly the layers ternary that ``skip`` selects in ``base`` (the same
    ``--skip`` as the run that wrote it); its other tensors (trained biases and norms) go into the
    dense model, so that a layer's gain is what its dense weight adds to the trained model. The
    choice is for training around (``choose_dense``'s ``fill``): within ``size_budget`` it takes
    layers in the ranking's order until the bound is met, those that gain nothing measured too.
    """
    from ternop.quant.distill import per_weight
    from ternop.quant.student_init import checkpoint_init
    from ternop.selection import select_linears

    model = _embedding_model(base)
    targets, _ = select_linears(model, skip)
    init, tensors = checkpoint_init(model, ckpt, targets, flag="--rank-from")
    model.load_state_dict(tensors, strict=False)
    ternary = {name: values.float() * per_weight(scale, values.shape[1]) for name, (values, scale) in init.items()}
    shapes = {name: tuple(w.shape) for name, w in ternary.items()}
    return _choose(base, model, ternary, max_loss, progress, size_budget, fill=True), shapes


def size_share(shapes: dict[str, tuple[int, int]], dense) -> float:
    """The bytes of the layers ``shapes`` (module name -> (N, K)) with ``dense`` ones in fp16 and the
    rest ternary, as a share of all of them in fp16."""
    fp16 = sum(2 * n * k for n, k in shapes.values())
    return sum(2 * n * k if name in dense else packed_bytes(n, k) for name, (n, k) in shapes.items()) / fp16


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

"""``ternop eval BASE QUANT``: the quality and memory of a ternary checkpoint against its base model.

Embedding models (the default path) are run through vLLM, or through transformers with
``--backend hf``, on the evaluation texts of :mod:`ternop.evaldata`. The report has
  - cosine between the ternary and the base embedding of each text (mean and min);
  - Lee-50 document-similarity Spearman, for both models;
  - wiki retrieval R@1, R@10 and MRR, for both models;
  - weight bytes on disk and in memory (linear-layer weights and total) and their ratios.
Causal LMs (``*ForCausalLM``) get wiki perplexity and the rate at which the ternary model's
top next token equals the base's, through transformers.

``--gate`` makes the exit code 1 when a metric is outside its threshold (:data:`DEFAULT_GATES`;
override with ``--min NAME=X`` / ``--max NAME=X`` or a JSON file ``{"min": {...}, "max": {...}}``).
The defaults catch a broken checkpoint (wrong codes, scales or layer mapping): a broken one
scores near random (cosine ~0, MRR ~0.06). They do not certify quality; raise them for a release.

Each vLLM model runs in its own subprocess (``python -m ternop.evaluate``): one ``LLM`` per
process is what vLLM supports, and it frees the first model's memory before the second loads.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ternop.cli.memory import disk_bytes, vllm_weight_memory, weight_memory

DEFAULT_GATES = {
    "embedding": {
        "min": {"mean_cosine": 0.30, "lee50_spearman": 0.30, "wiki_mrr": 0.20, "linear_weight_ratio": 7.0},
        "max": {},
    },
    "causal": {
        "min": {"top1_agreement": 0.05, "linear_weight_ratio": 7.0},
        "max": {"ppl_ratio": 1000.0},
    },
}

# ----------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------


def is_causal_lm(model_dir) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return any(a.endswith("ForCausalLM") for a in config.get("architectures") or [])


def load_hf_model(model_dir, causal: bool, dtype: torch.dtype = torch.float32, meta: bool = False) -> torch.nn.Module:
    """An HF model for ``model_dir``; a ternary checkpoint's layers become ``TernaryLinear`` (the ternop op).

    ``meta=True`` builds it on the meta device without reading weights: the layout, for counting bytes.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from ternop.checkpoint import read_quant_config
    from ternop.modules import TernaryLinear

    auto = AutoModelForCausalLM if causal else AutoModel
    quantized = read_quant_config(model_dir) is not None
    if not quantized and not meta:
        return auto.from_pretrained(str(model_dir), dtype=dtype).eval()
    config_dict = json.loads((Path(model_dir) / "config.json").read_text())
    config_dict.pop("quantization_config", None)
    with torch.device("meta" if meta else "cpu"):
        model = auto.from_config(AutoConfig.for_model(**config_dict), dtype=dtype).eval()
    if not quantized:
        return model
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "") + "."

    def local(name: str) -> str:
        # An encoder saved from a *ForXxx class has "bert." / "model." in front of AutoModel's names.
        return name if name.split(".")[0] in modules or name in modules else name.removeprefix(prefix)

    files = sorted(Path(model_dir).glob("*.safetensors"))
    state = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(".weight_packed"):
                    ckpt_name = name.removesuffix(".weight_packed")
                    target = modules.get(local(ckpt_name))
                    if not isinstance(target, torch.nn.Linear):
                        raise ValueError(f"{model_dir}: ternary layer {ckpt_name} has no nn.Linear in the model")
                    layer = TernaryLinear(target.in_features, target.out_features, bias=target.bias is not None,
                                          dtype=dtype, device="meta" if meta else None)
                    parent, _, child = local(ckpt_name).rpartition(".")
                    setattr(model.get_submodule(parent) if parent else model, child, layer)
                if not meta:
                    state[local(name)] = f.get_tensor(name)
    if meta:
        return model
    missing, _ = model.load_state_dict(state, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [m for m in missing if "position_ids" not in m and not m.startswith("pooler.")
               and not (tied and m == "lm_head.weight")]
    if missing:
        raise ValueError(f"{model_dir}: no weights in the checkpoint for {missing[:5]}")
    if causal and tied:
        model.tie_weights()
    return model


# ----------------------------------------------------------------------------------------
# Embeddings: one model per call, HF in-process or vLLM in a subprocess
# ----------------------------------------------------------------------------------------


def max_length(model_dir) -> int:
    """Tokens per text: sentence-transformers' max_seq_length, within the model's position table."""
    from ternop.cli.evaldata import max_seq_length

    config = json.loads((Path(model_dir) / "config.json").read_text())
    positions = config.get("max_position_embeddings") or 1 << 30
    return min(max_seq_length(str(model_dir)), positions)


def _token_ids(model_dir, texts) -> tuple[list[list[int]], int]:
    """Token ids truncated as sentence-transformers does, so both backends see the same input."""
    from transformers import AutoTokenizer

    max_len = max_length(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok(list(texts), truncation=True, max_length=max_len)["input_ids"], max_len


def embed_hf_model(model_dir, texts, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    from transformers import AutoTokenizer

    from ternop.cli.evaldata import embed_model, pooling_mode

    model = load_hf_model(model_dir, causal=False, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    emb = embed_model(model, tok, texts, pooling_mode(str(model_dir)), 16, max_length(model_dir))
    return emb, {}


def embed_vllm(model_dir, texts, dtype: str, eager: bool, log_path) -> tuple[torch.Tensor, dict]:
    """Embeds ``texts`` in a fresh ``python -m ternop.evaluate`` process -> (float32 [N, D], memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        out = Path(tmp) / "out.pt"
        job.write_text(json.dumps({"model": str(model_dir), "texts": list(texts), "dtype": dtype, "eager": eager}))
        from ternop.cli.serve import with_cpu_defaults

        env = with_cpu_defaults(dict(os.environ))
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: faster start, model reachable
        with open(log_path, "ab") as log:
            rc = subprocess.call([sys.executable, "-m", "ternop.cli.evaluate", str(job), str(out)], env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
        if rc != 0 or not out.exists():
            tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM embedding of {model_dir} failed (exit {rc}); log {log_path}:\n{tail}")
        result = torch.load(out)
    return result["embeddings"], result["memory"]


def _vllm_worker(job_path: str, out_path: str) -> int:
    from vllm import LLM

    job = json.loads(Path(job_path).read_text())
    ids, max_len = _token_ids(job["model"], job["texts"])
    llm = LLM(model=job["model"], runner="pooling", dtype=job["dtype"], max_model_len=max_len,
              enforce_eager=job["eager"], seed=0)
    outputs = llm.embed([{"prompt_token_ids": x} for x in ids], use_tqdm=False)
    emb = torch.nn.functional.normalize(torch.tensor([o.outputs.embedding for o in outputs], dtype=torch.float32), dim=-1)
    try:
        memory = llm.apply_model(vllm_weight_memory)[0]
    except Exception as e:  # noqa: BLE001 - memory is reported as unknown rather than failing the run
        print(f"ternop eval: could not read the model's memory from vLLM: {e}", file=sys.stderr)
        memory = {}
    torch.save({"embeddings": emb, "memory": memory}, out_path)
    return 0


# ----------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------


def embedding_report(base, quant, backend: str, dtype: str, eager: bool, log_path) -> dict:
    from ternop.cli import evaldata

    lee_docs, _ = evaldata.lee50()
    queries, docs = evaldata.wiki_retrieval()
    texts = lee_docs + queries + docs
    n_lee, n_q = len(lee_docs), len(queries)
    models, memory = {}, {}
    for role, path in (("base", base), ("ternary", quant)):
        t0 = time.monotonic()
        _say(f"embedding {len(texts)} texts with the {role} model through {backend} ...")
        if backend == "vllm":
            emb, mem = embed_vllm(path, texts, dtype, eager, log_path)
        else:
            emb, mem = embed_hf_model(path, texts, getattr(torch, dtype))
        _say(f"  done in {time.monotonic() - t0:.1f} s")
        retrieval = evaldata.retrieval_metrics(emb[n_lee : n_lee + n_q], emb[n_lee + n_q :])
        models[role] = {
            "lee50_spearman": evaldata.lee50_spearman(emb[:n_lee]),
            **{f"wiki_{k}": v for k, v in retrieval.items()},
            "_emb": emb,
        }
        memory[role] = mem
    cos = (models["base"].pop("_emb") * models["ternary"].pop("_emb")).sum(-1)
    agreement = {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()), "n_texts": len(texts)}
    return {"kind": "embedding", "models": models, "agreement": agreement, "memory": memory}


@torch.no_grad()
def causal_report(base, quant, dtype: str, max_tokens: int) -> dict:
    """Perplexity on the wiki sample for both models, and the same-top-token rate, through transformers."""
    from transformers import AutoTokenizer

    from ternop.cli.evaldata import perplexity_texts

    tok = AutoTokenizer.from_pretrained(str(base))
    window = min(512, json.loads((Path(base) / "config.json").read_text()).get("max_position_embeddings") or 512)
    docs = [tok(t, return_tensors="pt")["input_ids"][:, :window] for t in perplexity_texts()]
    budget, batches = max_tokens, []
    for ids in docs:
        if budget <= 0:
            break
        batches.append(ids[:, :budget])
        budget -= batches[-1].shape[1]
    models, memory, top = {}, {}, {}
    for role, path in (("base", base), ("ternary", quant)):
        _say(f"scoring {sum(b.shape[1] for b in batches)} tokens with the {role} model through transformers ...")
        model = load_hf_model(path, causal=True, dtype=getattr(torch, dtype))
        nll, count, tops = 0.0, 0, []
        for ids in batches:
            logits = model(input_ids=ids).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
            tops.append(logits.argmax(-1))
        models[role] = {"perplexity": math.exp(nll / count), "tokens": count}
        memory[role] = {}
        top[role] = torch.cat(tops)
        del model
    agreement = {
        "top1_agreement": float((top["base"] == top["ternary"]).float().mean()),
        "ppl_ratio": models["ternary"]["perplexity"] / models["base"]["perplexity"],
    }
    return {"kind": "causal", "models": models, "agreement": agreement, "memory": memory}


def add_memory(report: dict, base, quant, dtype: str) -> None:
    """Adds bytes on disk, in memory (the model as ternop builds it, in ``dtype``) and the ratios."""
    from ternop.checkpoint import load_ternary_layers

    prefixes = list(load_ternary_layers(quant))
    causal = report["kind"] == "causal"
    mem = report["memory"]
    layouts = {role: load_hf_model(path, causal, getattr(torch, dtype), meta=True)
               for role, path in (("base", base), ("ternary", quant))}  # fmt: skip
    # The same architecture class builds both, so module names match: count the quantized layers only.
    names = {n for n, m in layouts["ternary"].named_modules() if type(m).__name__ == "TernaryLinear"}
    for role, path in (("base", base), ("ternary", quant)):
        layout = weight_memory(layouts[role], names)
        mem[role] = {**disk_bytes(path, prefixes), **layout, **mem.get(role, {})}
    b, t = mem["base"], mem["ternary"]
    mem["ratios"] = {key: b[key] / t[key] for key in _MEMORY_ROWS if b.get(key) and t.get(key)}
    mem["quantized_layers"] = len(prefixes)


_MEMORY_ROWS = {
    "disk_linear": "quantized layers' weights on disk",
    "mem_linear": "quantized layers' weights in memory",
    "vllm_mem_linear": "all linear weights in vLLM",
    "disk_total": "all weights on disk",
    "mem_total": "all weights in memory",
    "vllm_mem_total": "all weights in vLLM",
}


def summary(report: dict) -> dict[str, float]:
    """The flat metrics the gate reads (ternary model's values)."""
    out = dict(report["agreement"])
    out.update(report["models"]["ternary"])
    ratios = report["memory"]["ratios"]
    out["linear_weight_ratio"] = ratios.get("mem_linear", float("nan"))
    return {k: v for k, v in out.items() if isinstance(v, (int, float))}


def check_gates(values: dict[str, float], gates: dict) -> list[str]:
    failures = []
    for name, limit in gates.get("min", {}).items():
        v = values.get(name)
        if v is None or not v >= limit:
            failures.append(f"{name} = {_g(v)} is below the minimum {limit}")
    for name, limit in gates.get("max", {}).items():
        v = values.get(name)
        if v is None or not v <= limit:
            failures.append(f"{name} = {_g(v)} is above the maximum {limit}")
    return failures


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------


def format_table(report: dict) -> str:
    rows = [("metric", "base", "ternary")]
    base, tern = report["models"]["base"], report["models"]["ternary"]
    labels = {"lee50_spearman": "Lee-50 Spearman", "wiki_r1": "wiki R@1", "wiki_r10": "wiki R@10",
              "wiki_mrr": "wiki MRR", "perplexity": "wiki perplexity", "tokens": "tokens scored"}
    for key, label in labels.items():
        if key in base:
            rows.append((label, _fmt(base[key]), _fmt(tern[key])))
    ag = report["agreement"]
    if report["kind"] == "embedding":
        rows.append(("cosine to base, mean", "1", _fmt(ag["mean_cosine"])))
        rows.append(("cosine to base, min", "1", _fmt(ag["min_cosine"])))
    else:
        rows.append(("same top token as base", "1", _fmt(ag["top1_agreement"])))
    mem = report["memory"]
    for key, label in _MEMORY_ROWS.items():
        b, t = mem["base"].get(key), mem["ternary"].get(key)
        if b and t:
            rows.append((label, _mb(b), f"{_mb(t)}  ({mem['ratios'][key]:.2f}x smaller)"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in width))
    gate = report.get("gate")
    if gate and gate.get("enabled"):
        lines.append("")
        lines.append("gate: " + ("PASS" if gate["passed"] else "FAIL"))
        lines += [f"  - {f}" for f in gate["failures"]]
    return "\n".join(lines)


def _g(v) -> str:
    return "missing" if v is None else f"{v:.4g}"


def _fmt(v) -> str:
    return f"{v:,}" if isinstance(v, int) else f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _say(msg: str) -> None:
    print(f"[eval] {msg}", file=sys.stderr, flush=True)


def load_gates(kind: str, path: str | None, mins: list[str], maxs: list[str]) -> dict:
    gates = json.loads(json.dumps(DEFAULT_GATES[kind]))
    if path:
        user = json.loads(Path(path).read_text())
        for side in ("min", "max"):
            gates[side].update(user.get(side, {}))
    for side, items in (("min", mins), ("max", maxs)):
        for item in items:
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--{side} expects NAME=VALUE, got {item!r}")
            if value.strip().lower() in ("", "none", "off"):
                gates[side].pop(name, None)
            else:
                gates[side][name] = float(value)
    return gates


# ----------------------------------------------------------------------------------------
# The subcommand
# ----------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("base", metavar="BASE", help="the fp model folder the checkpoint was made from")
    parser.add_argument("quant", metavar="QUANT", help="the ternary v1 checkpoint")
    parser.add_argument("--json", metavar="OUT", default=None, help="write the full report as JSON")
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm",
                        help="embedding models: run through vLLM (default) or transformers; causal LMs use hf")
    parser.add_argument("--dtype", default="float32", help="activation dtype for both models (float32, bfloat16, ...)")
    parser.add_argument("--compile", action="store_true", help="vLLM: compile the model (default: eager)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="causal LMs: tokens scored for perplexity")
    parser.add_argument("--gate", action="store_true", help="exit 1 when a metric is outside its threshold")
    parser.add_argument("--thresholds", metavar="FILE", default=None,
                        help='JSON {"min": {NAME: X}, "max": {NAME: X}} overriding the default gates')
    parser.add_argument("--min", action="append", default=[], metavar="NAME=X",
                        help="a lower bound, e.g. --min mean_cosine=0.5 (NAME=off drops a default)")
    parser.add_argument("--max", action="append", default=[], metavar="NAME=X", help="an upper bound, e.g. --max ppl_ratio=3")
    parser.add_argument("--log", default=None, help="where vLLM's output goes (default: a file next to --json, or a temp file)")


def main(args) -> int:
    from ternop.cli import evaldata
    from ternop.checkpoint import read_quant_config

    if read_quant_config(args.quant) is None:
        print(f"ternop eval: {args.quant} is not a ternary checkpoint (no quantization_config)", file=sys.stderr)
        return 2
    kind = "causal" if is_causal_lm(args.base) else "embedding"
    try:
        gates = load_gates(kind, args.thresholds, args.min, args.max)
        evaldata.require()  # before any model loads: fail in a second, not after minutes
    except (ValueError, OSError, evaldata.EvalDataError) as e:
        print(f"ternop eval: {e}", file=sys.stderr)
        return 2
    log = args.log or (str(Path(args.json).with_suffix(".vllm.log")) if args.json else
                       os.path.join(tempfile.gettempdir(), f"ternop-eval-{os.getpid()}.log"))
    backend = args.backend if kind == "embedding" else "hf"
    t0 = time.monotonic()
    if kind == "embedding":
        report = embedding_report(args.base, args.quant, backend, args.dtype, not args.compile, log)
    else:
        report = causal_report(args.base, args.quant, args.dtype, args.max_tokens)
    add_memory(report, args.base, args.quant, args.dtype)
    values = summary(report)
    failures = check_gates(values, gates)
    report.update({
        "base": str(args.base), "quant": str(args.quant), "backend": backend, "dtype": args.dtype,
        "seconds": round(time.monotonic() - t0, 1), "summary": values,
        "gate": {"enabled": args.gate, "thresholds": gates, "failures": failures, "passed": not failures},
    })
    print(format_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _say(f"wrote {args.json}")
    return 1 if args.gate and failures else 0


if __name__ == "__main__":
    sys.exit(_vllm_worker(*sys.argv[1:3]))

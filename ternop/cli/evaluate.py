"""``ternop eval BASE QUANT``: the quality and memory of a ternary checkpoint against its base model.

Embedding models (the default path) are run through vLLM, or through transformers with
``--backend hf``, on the evaluation texts of :mod:`ternop.cli.evaldata`. The report has
  - cosine between the ternary and the base embedding of each text (mean and min);
  - Lee-50 document-similarity Spearman, for both models;
  - wiki retrieval R@1, R@10 and MRR, for both models;
  - weight bytes on disk and in memory (linear-layer weights and total) and their ratios.
Causal LMs (``*ForCausalLM``) get wiki perplexity and the rate at which the ternary model's
top next token equals the base's, through transformers.

``--activations`` picks the mode the ternary weights run in: the checkpoint's own
``activation_bits`` (the default), ``fp`` (16), ``int8`` (8), or ``both``. With ``both`` the same
weights run twice: ``models.ternary`` is A16 and ``models.ternary_a8`` is A8, and the report adds
the cosine between the A8 and the A16 embedding of each text (``a8_vs_a16_mean_cosine``) and the
MRR the A8 run loses (``a8_wiki_mrr_drop``); every A8 value is also in the summary as ``a8_<name>``,
so gates can read them. A mode other than the checkpoint's runs on a copy of its folder whose
config.json says that mode (the weights are linked, not copied).

``--gate`` makes the exit code 1 when a metric is outside its threshold (:data:`DEFAULT_GATES`;
override with ``--min NAME=X`` / ``--max NAME=X`` or a JSON file ``{"min": {...}, "max": {...}}``).
The defaults catch a broken checkpoint (wrong codes, scales or layer mapping): a broken one
scores near random (cosine ~0, MRR ~0.06). They do not certify quality; raise them for a release.

Each vLLM model runs in its own subprocess (``python -m ternop.cli.evaluate``): one ``LLM`` per
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
from ternop.cli.modes import ACTIVATION_CHOICES, activation_runs, activation_view, label, role_prefix

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

def embed_hf_model(model_dir, texts, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """Embeds ``texts`` through transformers (ternary layers via ternop's HF quantizer) -> (float32 [N, D], {})."""
    from ternop.hf import embed_texts

    return embed_texts(model_dir, texts, dtype=dtype, batch_size=16), {}


def embed_vllm(model_dir, texts, dtype: str, eager: bool, log_path) -> tuple[torch.Tensor, dict]:
    """Embeds ``texts`` in a fresh ``python -m ternop.cli.evaluate`` process -> (float32 [N, D], memory)."""
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

    from ternop.hf.embedding import max_seq_length, token_ids

    job = json.loads(Path(job_path).read_text())
    ids, max_len = token_ids(job["model"], job["texts"]), max_seq_length(job["model"])
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


def embedding_report(base, quant, backend: str, dtype: str, eager: bool, log_path,
                     runs: list[tuple[str, int | None]] = (("ternary", None),), heldout: bool = True) -> dict:  # fmt: skip
    """Embeds the evaluation texts (visible, and the held-out split) with the base model and each ternary run."""
    from ternop.cli import evaldata

    suite = evaldata.suite(heldout)
    texts, nv = suite.texts, suite.n_visible
    models, memory, emb = {}, {}, {}
    for role, path, bits in [("base", base, None), *((role, quant, bits) for role, bits in runs)]:
        t0 = time.monotonic()
        mode = "" if bits is None else f" (activation_bits {bits})"
        _say(f"embedding {len(texts)} texts with the {role} model{mode} through {backend} ...")
        with activation_view(path, bits) as folder:
            if backend == "vllm":
                emb[role], mem = embed_vllm(folder, texts, dtype, eager, log_path)
            else:
                emb[role], mem = embed_hf_model(folder, texts, getattr(torch, dtype))
        _say(f"  done in {time.monotonic() - t0:.1f} s")
        models[role] = suite.score(emb[role])
        memory.setdefault("ternary" if role.startswith("ternary") else role, mem)
    agreement = {"n_texts": nv, "n_heldout_texts": len(texts) - nv}
    for role, _ in runs:
        p = role_prefix(role)
        # Visible texts keep the names they always had; the held-out ones get their own.
        agreement.update(_cosines(p, emb[role][:nv], emb["base"][:nv]))
        if len(texts) > nv:
            agreement.update(_cosines(f"{p}heldout_", emb[role][nv:], emb["base"][nv:]))
        if role != "ternary":
            agreement.update(_cosines(f"{p}vs_a16_", emb[role], emb["ternary"]))
    return {"kind": "embedding", "models": models, "agreement": agreement, "memory": memory}


def _cosines(prefix: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    cos = (a * b).sum(-1)
    return {f"{prefix}mean_cosine": float(cos.mean()), f"{prefix}min_cosine": float(cos.min())}


@torch.no_grad()
def causal_report(base, quant, dtype: str, max_tokens: int,
                  runs: list[tuple[str, int | None]] = (("ternary", None),)) -> dict:  # fmt: skip
    """Perplexity on the wiki sample for the base and each ternary run, and the same-top-token rate."""
    from ternop.cli.evaldata import perplexity_texts
    from ternop.hf import load_model, load_tokenizer

    tok = load_tokenizer(base)
    window = min(512, json.loads((Path(base) / "config.json").read_text()).get("max_position_embeddings") or 512)
    docs = [tok(t, return_tensors="pt")["input_ids"][:, :window] for t in perplexity_texts()]
    budget, batches = max_tokens, []
    for ids in docs:
        if budget <= 0:
            break
        batches.append(ids[:, :budget])
        budget -= batches[-1].shape[1]
    models, memory, top = {}, {}, {}
    for role, path, bits in [("base", base, None), *((role, quant, bits) for role, bits in runs)]:
        mode = "" if bits is None else f" (activation_bits {bits})"
        _say(f"scoring {sum(b.shape[1] for b in batches)} tokens with the {role} model{mode} through transformers ...")
        with activation_view(path, bits) as folder:
            model = load_model(folder, causal=True, dtype=getattr(torch, dtype))
        nll, count, tops = 0.0, 0, []
        for ids in batches:
            logits = model(input_ids=ids).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
            tops.append(logits.argmax(-1))
        models[role] = {"perplexity": math.exp(nll / count), "tokens": count}
        memory.setdefault("ternary" if role.startswith("ternary") else role, {})
        top[role] = torch.cat(tops)
        del model
    agreement = {}
    for role, _ in runs:
        p = role_prefix(role)
        agreement[f"{p}top1_agreement"] = float((top["base"] == top[role]).float().mean())
        agreement[f"{p}ppl_ratio"] = models[role]["perplexity"] / models["base"]["perplexity"]
        if role != "ternary":
            agreement[f"{p}vs_a16_top1_agreement"] = float((top["ternary"] == top[role]).float().mean())
    return {"kind": "causal", "models": models, "agreement": agreement, "memory": memory}


def add_memory(report: dict, base, quant, dtype: str) -> None:
    """Adds bytes on disk, in memory (the model as ternop builds it, in ``dtype``) and the ratios."""
    from ternop.checkpoint import ternary_prefixes
    from ternop.hf import build_layout

    prefixes = ternary_prefixes(quant)
    causal = report["kind"] == "causal"
    mem = report["memory"]
    layouts = {role: build_layout(path, causal=causal, dtype=getattr(torch, dtype))
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
    """The flat metrics the gate reads: the ternary model's values, and ``a8_<name>`` for an A8 run beside it."""
    out = dict(report["agreement"])
    out.update(report["models"]["ternary"])
    if "ternary_a8" in report["models"]:
        a8 = report["models"]["ternary_a8"]
        out.update({f"a8_{k}": v for k, v in a8.items()})
        if "wiki_mrr" in a8:
            out["a8_wiki_mrr_drop"] = report["models"]["ternary"]["wiki_mrr"] - a8["wiki_mrr"]
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


def format_table(report: dict) -> str:
    roles = [r for r in report["models"] if r != "base"]  # "ternary", then "ternary_a8" with --activations both
    bits = [report.get("activation_bits", {}).get(r, 16) for r in roles]
    heads = ["ternary"] if bits == [16] else [f"ternary {label(b)}" for b in bits]
    models, ag = report["models"], report["agreement"]
    rows = [("metric", "base", *heads)]
    labels = {"lee50_spearman": "Lee-50 Spearman", "wiki_r1": "wiki R@1", "wiki_r10": "wiki R@10",
              "wiki_mrr": "wiki MRR", "perplexity": "wiki perplexity", "tokens": "tokens scored",
              "heldout_passage_mrr": "held-out passages MRR", "heldout_short_mrr": "held-out short queries MRR",
              "heldout_simlex_spearman": "held-out SimLex-999", "heldout_wordsim_spearman": "held-out WordSim-353"}
    for key, text in labels.items():
        if key in models["base"]:
            rows.append((text, *(_fmt(models[r][key]) for r in ["base", *roles])))
    pairs = {"embedding": [(f"cosine to base, {s}", f"{s}_cosine") for s in ("mean", "min")],
             "causal": [("same top token as base", "top1_agreement")]}[report["kind"]]  # fmt: skip
    held = [(f"held-out cosine to base, {s}", f"heldout_{s}_cosine") for s in ("mean", "min") if f"heldout_{s}_cosine" in ag]
    for text, key in pairs + held:
        rows.append((text, "1", *(_fmt(ag[role_prefix(r) + key]) for r in roles)))
    for r in roles[1:]:  # the A8 run against the A16 run of the same weights (every text)
        for text, key in pairs:
            rows.append((text.replace("base", "A16"), "-", "1", f"{ag[f'{role_prefix(r)}vs_a16_{key}']:.4f}"))
    mem = report["memory"]
    for key, text in _MEMORY_ROWS.items():
        b, t = mem["base"].get(key), mem["ternary"].get(key)
        if b and t:
            same = ["same weights"] * (len(roles) - 1)
            rows.append((text, _mb(b), f"{_mb(t)}  ({mem['ratios'][key]:.2f}x smaller)", *same))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
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


def add_arguments(parser) -> None:
    parser.add_argument("base", metavar="BASE", help="the fp model folder the checkpoint was made from")
    parser.add_argument("quant", metavar="QUANT", help="the ternary v1 checkpoint")
    parser.add_argument("--json", metavar="OUT", default=None,
                        help="write the full report as JSON to OUT (its folder is created if missing)")
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm",
                        help="embedding models: run through vLLM or transformers; causal LMs always use hf")
    parser.add_argument("--dtype", default="float32", help="activation dtype for both models (float32, bfloat16, ...)")
    parser.add_argument("--activations", choices=ACTIVATION_CHOICES, default="checkpoint",
                        help="the mode the ternary weights run in: the checkpoint's activation_bits, fp (16), int8 (8), "
                             "or both (A16 and A8 on the same weights, with the cosine between them)")
    parser.add_argument("--compile", action="store_true", help="vLLM: compile the model instead of running eager")
    parser.add_argument("--no-heldout", dest="heldout", action="store_false",
                        help="embedding models: score the visible sets only (Lee-50, wiki retrieval), not the held-out split")
    parser.add_argument("--max-tokens", type=int, default=8192, help="causal LMs: tokens scored for perplexity")
    parser.add_argument("--gate", action="store_true", help="exit 1 when a metric is outside its threshold")
    parser.add_argument("--thresholds", metavar="FILE", default=None,
                        help='JSON {"min": {NAME: X}, "max": {NAME: X}} overriding the default gates')
    parser.add_argument("--min", action="append", default=[], metavar="NAME=X",
                        help="a lower bound, e.g. --min mean_cosine=0.5 (NAME=off drops a default)")
    parser.add_argument("--max", action="append", default=[], metavar="NAME=X", help="an upper bound, e.g. --max ppl_ratio=3")
    parser.add_argument("--log", default=None, help="where vLLM's output goes (default: a file next to --json, or a temp file)")


def main(args) -> int:
    from ternop.checkpoint import model_folder, read_quant_config, safetensors_files
    from ternop.cli import evaldata
    from ternop.hf.loading import is_causal_lm

    # Every check that needs no model runs first: a mistake costs a second, not minutes of embedding.
    safetensors_files(model_folder(args.base))
    qc = read_quant_config(args.quant)  # an unknown activation_bits is an error here, naming the field
    if qc is None:
        print(f"ternop eval: error: {args.quant} is not a ternary checkpoint (no quantization_config)", file=sys.stderr)
        return 2
    runs = activation_runs(args.activations, qc["activation_bits"])
    kind = "causal" if is_causal_lm(args.base) else "embedding"
    gates = load_gates(kind, args.thresholds, args.min, args.max)
    evaldata.require()
    if args.json:
        out = Path(args.json)
        if out.is_dir():
            raise ValueError(f"--json {args.json!r} is a folder; name the file to write")
        out.parent.mkdir(parents=True, exist_ok=True)
    log = args.log or (str(Path(args.json).with_suffix(".vllm.log")) if args.json else
                       os.path.join(tempfile.gettempdir(), f"ternop-eval-{os.getpid()}.log"))
    backend = args.backend if kind == "embedding" else "hf"
    t0 = time.monotonic()
    if kind == "embedding":
        report = embedding_report(args.base, args.quant, backend, args.dtype, not args.compile, log, runs,
                                  heldout=args.heldout)  # fmt: skip
    else:
        report = causal_report(args.base, args.quant, args.dtype, args.max_tokens, runs)
    report["activation_bits"] = dict(runs)
    report["checkpoint_activation_bits"] = qc["activation_bits"]
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
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        _say(f"wrote {args.json}")
    return 1 if args.gate and failures else 0


if __name__ == "__main__":
    sys.exit(_vllm_worker(*sys.argv[1:3]))

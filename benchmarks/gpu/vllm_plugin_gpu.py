"""The ternary vLLM plugin on CUDA: compiled + CUDA-graph runs against the HF reference, validate, TP=2.

Run from the repository root on the GPU machine (vLLM 0.26 with ternop installed, so the
``vllm.general_plugins`` entry point is visible to every vLLM process):

    python benchmarks/gpu/vllm_plugin_gpu.py --out benchmarks/results/h200/vllm_plugin
    python benchmarks/gpu/vllm_plugin_gpu.py --out benchmarks/results/h200x2/vllm_plugin --tp 2 --skip-single [--skip-validate]
        [--tp-runs qwen3-medium:float32,qwen3-medium-fp:bfloat16]

What it does:
  1. builds tiny random Qwen3 and BERT models (tests/models.py) and a larger Qwen3-shaped one,
     and quantizes them with ``ternop quantize``;
  2. single GPU: vLLM ``embed`` with compilation and CUDA graphs on (the default), fp32 and bf16,
     each LLM in its own process, compared per prompt with HF transformers on the dequantized
     weights (fp32, CPU); then ``ternop validate`` (GPU_LOAD must be OK);
  3. ``--tp 2``: the Qwen3-shaped models at tensor_parallel_size=2 against TP=1 (bf16 cosine
     >= 0.9999, fp32 >= 0.99999) and ``ternop validate --tp 2`` (TP_SHARD must be OK).
     ``qwen3-medium-fp`` is the unquantized source of ``qwen3-medium``: vLLM's own path, a
     control for how far TP=2 moves the embeddings without ternop (never counted as a failure).
Writes ``vllm_plugin_gpu.json`` (every figure) and ``vllm_plugin_gpu.log`` (all child output) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Thresholds: fp32 runs must match the fp32 HF reference like the CPU tests; bf16 runs carry bf16
# activation rounding through every layer, so they are held to a looser per-prompt cosine.
COS_MIN = {"float32": 0.99999, "bfloat16": 0.999}
TP_COS_MIN = {"float32": 0.99999, "bfloat16": 0.9999}
TP_MODELS = ("qwen3-medium", "tiny-qwen3", "qwen3-medium-fp")

# NVLink multicast must stay off on shared hosts; children inherit these.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def _child(spec_path: str) -> int:
    """One LLM in this process: embed the prompts and save them (+ which linear methods were used)."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    from ternop.vllm_plugin import linear_methods, register

    register()
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], runner="pooling", dtype=spec["dtype"], max_model_len=128,
              enforce_eager=spec["eager"], tensor_parallel_size=spec["tp"], seed=0,
              gpu_memory_utilization=0.3)  # fmt: skip
    t_load = time.perf_counter() - t0
    outs = llm.embed(spec["prompts"])
    t_embed = time.perf_counter() - t0 - t_load
    try:
        methods = llm.apply_model(linear_methods)
    except Exception as e:  # noqa: BLE001  (only informative; the embeddings are the check)
        methods = [f"apply_model failed: {type(e).__name__}: {e}"]
    vecs = torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float32)
    torch.save(vecs, spec["out"])
    Path(spec["out"] + ".json").write_text(json.dumps({"methods": methods, "load_s": t_load, "embed_s": t_embed}))
    return 0


class Runner:
    def __init__(self, out: Path, work: Path):
        self.out, self.work = out, work
        self.log = open(out / "vllm_plugin_gpu.log", "a")
        self.results: dict = {"runs": [], "validate": [], "tp": [], "env": {}}
        self.n = 0

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def subprocess(self, argv: list[str], timeout: int) -> subprocess.CompletedProcess:
        env = {**os.environ, **SAFE_ENV}
        self.log.write(f"$ {' '.join(argv)}\n")
        self.log.flush()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            self.log.write(f"TIMEOUT after {timeout}s\n{e.stdout or ''}{e.stderr or ''}\n")
            return subprocess.CompletedProcess(argv, 124, "", f"timeout after {timeout}s")
        self.log.write(proc.stdout + proc.stderr + f"\n(rc={proc.returncode})\n")
        self.log.flush()
        return proc

    def embed(self, model: Path, dtype: str, eager: bool, tp: int, prompts: list[str]):
        import torch

        self.n += 1
        spec = {"model": str(model), "dtype": dtype, "eager": eager, "tp": tp, "prompts": prompts,
                "out": str(self.work / f"emb{self.n}.pt")}  # fmt: skip
        spec_path = self.work / f"spec{self.n}.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        proc = self.subprocess([sys.executable, __file__, "--child", str(spec_path)], timeout=420)
        info = {"model": model.name, "dtype": dtype, "eager": eager, "tp": tp, "rc": proc.returncode,
                "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        if proc.returncode != 0:
            info["error"] = (proc.stderr or proc.stdout)[-1500:]
            return None, info
        info.update(json.loads(Path(spec["out"] + ".json").read_text()))
        if isinstance(info["methods"][0], dict):
            info["ternary_layers"] = info["methods"][0].get("TernaryLinearMethod", 0)
        return torch.nn.functional.normalize(torch.load(spec["out"]), dim=-1), info

    def save(self) -> None:
        (self.out / "vllm_plugin_gpu.json").write_text(json.dumps(self.results, indent=2, default=str) + "\n")


def _build_models(work: Path, with_medium: bool) -> dict[str, tuple[Path, str]]:
    from ternop.quant.convert import quantize_checkpoint
    from tests.models import qwen3_medium, tiny_bert, tiny_qwen3

    models = {}
    for name, build, pooling in (("tiny-bert", tiny_bert, "cls"), ("tiny-qwen3", tiny_qwen3, "last")):
        quantize_checkpoint(build(work / f"{name}-fp"), work / name, progress=False)
        models[name] = (work / name, pooling)
    if with_medium:
        fp = qwen3_medium(work / "qwen3-medium-fp")
        quantize_checkpoint(fp, work / "qwen3-medium", progress=False)
        models["qwen3-medium"] = (work / "qwen3-medium", "last")
        models["qwen3-medium-fp"] = (Path(fp), "last")
    return models


def _cosines(a, b) -> list[float]:
    return [round(float(x), 7) for x in (a * b).sum(-1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for vllm_plugin_gpu.json and vllm_plugin_gpu.log")
    parser.add_argument("--tp", type=int, default=1, help="also compare tensor_parallel_size=TP with TP=1")
    parser.add_argument("--skip-single", action="store_true", help="only the TP part")
    parser.add_argument("--skip-validate", action="store_true", help="no ternop validate runs (about a minute)")
    parser.add_argument("--tp-runs", default="qwen3-medium:bfloat16,tiny-qwen3:bfloat16",
                        help="comma-separated MODEL:DTYPE pairs for the TP comparison, run in this order; "
                             f"MODEL is one of {', '.join(TP_MODELS)} (default: %(default)s)")
    parser.add_argument("--eager-too", action="store_true", help="also run with enforce_eager=True")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.child)
    if not args.out:
        parser.error("--out is required")
    tp_runs = [tuple(run.split(":", 1)) for run in args.tp_runs.split(",")]
    bad = [":".join(r) for r in tp_runs if len(r) != 2 or r[0] not in TP_MODELS or r[1] not in TP_COS_MIN]
    if bad:
        parser.error(f"--tp-runs: cannot read {bad}; use MODEL:DTYPE with MODEL in {TP_MODELS} "
                     f"and DTYPE in {tuple(TP_COS_MIN)}")  # fmt: skip

    import torch

    from tests.models import PROMPTS, hf_embed, hf_model_from_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ternop-vllm-gpu-"))
    r = Runner(out, work)
    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception as e:  # noqa: BLE001
        vllm_version = f"not importable: {e}"
    r.results["env"] = {
        "vllm": vllm_version, "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "python": sys.version.split()[0],
    }  # fmt: skip
    r.say(f"env: {r.results['env']}")
    models = _build_models(work, with_medium=args.tp > 1)
    prompts = PROMPTS * 4  # 16 prompts: several batch sizes go through the CUDA graphs
    failures = []

    refs = {}
    for name, (path, pooling) in models.items():
        if not name.endswith("-fp"):
            refs[name] = hf_embed(hf_model_from_checkpoint(path), path, prompts, pooling)

    if not args.skip_single:
        modes = [False, True] if args.eager_too else [False]
        for name in ("tiny-bert", "tiny-qwen3"):
            path, _ = models[name]
            for dtype in ("float32", "bfloat16"):
                for eager in modes:
                    got, info = r.embed(path, dtype, eager, 1, prompts)
                    if got is not None:
                        cos = _cosines(got, refs[name])
                        info.update(min_cosine=min(cos), cosines=cos, threshold=COS_MIN[dtype])
                        # Zero ternary layers would mean the checkpoint ran through some other method.
                        info["ok"] = min(cos) >= COS_MIN[dtype] and info.get("ternary_layers") != 0
                    else:
                        info["ok"] = False
                    if not info["ok"]:
                        failures.append(f"embed {name} {dtype} eager={eager}")
                    r.results["runs"].append(info)
                    r.say(f"embed {name} {dtype} eager={eager}: ok={info['ok']} "
                          f"min_cos={info.get('min_cosine')} wall={info['wall_s']}s")  # fmt: skip
                    r.save()

    to_validate = {name: m for name, m in models.items() if name in refs}
    for name, (path, _) in ({} if args.skip_validate else to_validate).items():
        proc = r.subprocess([sys.executable, "-m", "ternop.cli", "validate", str(path), "--tp", str(max(2, args.tp))],
                            timeout=300)  # fmt: skip
        lines = proc.stdout.splitlines()
        ok = proc.returncode == 0 and any(line.startswith("GPU_LOAD: OK") for line in lines)
        r.results["validate"].append({"model": name, "tp": max(2, args.tp), "rc": proc.returncode, "lines": lines,
                                      "ok": ok})  # fmt: skip
        r.say(f"validate {name}: rc={proc.returncode} {lines}")
        if not ok:
            failures.append(f"validate {name}")
        r.save()

    if args.tp > 1:
        for name, dtype in tp_runs:
            path, _ = models[name]
            control = name not in refs
            base, info1 = r.embed(path, dtype, False, 1, prompts)
            multi, info2 = r.embed(path, dtype, False, args.tp, prompts)
            entry = {"model": name, "dtype": dtype, "tp": args.tp, "control": control, "tp1": info1, "tpN": info2}
            if base is not None and multi is not None:
                cos = _cosines(base, multi)
                entry.update(min_cosine=min(cos), cosines=cos, threshold=TP_COS_MIN[dtype],
                             ok=min(cos) >= TP_COS_MIN[dtype])  # fmt: skip
                if not control:
                    entry.update(min_cosine_tp1_vs_hf=min(_cosines(base, refs[name])),
                                 min_cosine_tpN_vs_hf=min(_cosines(multi, refs[name])))  # fmt: skip
            else:
                entry["ok"] = False
            if not entry["ok"] and not control:
                failures.append(f"tp{args.tp} {name} {dtype}")
            r.results["tp"].append(entry)
            r.say(f"TP={args.tp} vs TP=1 {name} {dtype}{' (control)' if control else ''}: ok={entry['ok']} "
                  f"min_cos={entry.get('min_cosine')}")  # fmt: skip
            r.save()

    r.results["failures"] = failures
    r.results["ok"] = not failures
    r.save()
    r.say(f"done: {'ALL OK' if not failures else 'FAILURES: ' + ', '.join(failures)}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

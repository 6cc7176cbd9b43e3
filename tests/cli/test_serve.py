"""``ternop serve``: the command line, and a served ternary MiniLM under load and bad input (loopback only).

One server (vLLM's OpenAI server, engine in-process) is started once for the module on a free
port and always stopped. Its limits are set low so that the tests reach them quickly:
at most 64 inputs per request, 256 requests in flight, a 1 MiB body, 128 tokens of context.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time

import pytest
import torch

from ternop.cli import serve
from tests.models import minilm_dir

MODEL = "minilm-ternary"
MAX_INPUTS, MAX_QUEUED, MAX_BODY, MAX_LEN = 64, 256, 1 << 20, 128


# ------------------------------------------------------------------------- command line (no server)


def _parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    serve.add_arguments(sub.add_parser("serve"))
    return parser.parse_args(["serve", *argv])


def test_serve_args_after_double_dash_go_to_vllm_last(tmp_path):
    args = _parse([str(minilm_dir()), "--port", "9123", "--", "--max-num-seqs", "8", "--port", "9999"])
    assert args.port == 9123 and args.vllm_args == ["--max-num-seqs", "8", "--port", "9999"]
    cmd = serve.build_command(args.model_dir, port=args.port, extra=args.vllm_args)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[-4:] == ["--max-num-seqs", "8", "--port", "9999"]  # last wins in vLLM's parser
    assert cmd[cmd.index("--runner") + 1] == "pooling"
    assert cmd[cmd.index("--middleware") + 1] == "ternop.cli.serve.RequestLimits"


def test_serve_runner_and_context_defaults(tmp_path):
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"],
                                                    "max_position_embeddings": 40960}))
    assert serve.detect_runner(causal) == "generate"
    assert serve.default_max_model_len(causal) == serve.LONG_CONTEXT_CAP
    assert serve.detect_runner(minilm_dir()) == "pooling"
    assert serve.default_max_model_len(minilm_dir()) is None
    with pytest.raises(FileNotFoundError, match="config.json"):
        serve.detect_runner(tmp_path)


def test_serve_batch_cap_never_exceeds_queue_cap():
    """A batch larger than the request queue would always get 503, so the input cap follows the queue cap."""
    if not serve.supports_queue_cap():
        pytest.skip("this vLLM has no --max-num-queued-reqs")
    cmd, env = serve.prepare(minilm_dir(), max_inputs=5000, max_queued_requests=100)
    assert env["TERNOP_SERVE_MAX_INPUTS"] == "100"
    assert cmd[cmd.index("--max-num-queued-reqs") + 1] == "100"


def _through_limits(body: bytes, monkeypatch, chunk: int = 1 << 16, path: str = "/v1/embeddings"):
    """Sends ``body`` through RequestLimits in front of an echo app -> (status, response body, body the app got)."""
    import asyncio

    monkeypatch.setenv("TERNOP_SERVE_MAX_INPUTS", "4")
    monkeypatch.setenv("TERNOP_SERVE_MAX_BODY_BYTES", "1000")
    seen = {}

    async def app(scope, receive, send):
        got, more = b"", True
        while more:
            msg = await receive()
            got += msg.get("body", b"")
            more = msg.get("more_body", False)
        seen["body"] = got
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(serve.RequestLimits(app)(scope, receive, send))
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:]), seen.get("body")


def test_serve_request_limits_middleware(monkeypatch):
    ok = json.dumps({"model": "m", "input": ["a", "b", "c", "d"]}).encode()
    assert _through_limits(ok, monkeypatch, chunk=7) == (200, b"ok", ok)  # replayed whole to the app
    status, body, seen = _through_limits(json.dumps({"input": ["a"] * 5}).encode(), monkeypatch)
    assert (status, seen) == (413, None) and "at most 4" in json.loads(body)["error"]["message"]
    status, body, seen = _through_limits(b'{"input": "' + b"x" * 2000 + b'"}', monkeypatch, chunk=100)
    assert (status, seen) == (413, None) and "1000 bytes" in json.loads(body)["error"]["message"]
    status, body, _ = _through_limits(b'{"input": ["\xff"]}', monkeypatch)
    assert status == 400 and "UTF-8" in json.loads(body)["error"]["message"]
    for passthrough in (b'{"input": [', b"[1, 2]", b'{"input": "text"}'):  # vLLM validates these itself
        assert _through_limits(passthrough, monkeypatch)[2] == passthrough
    big = json.dumps({"input": ["a"] * 5}).encode()
    assert _through_limits(big, monkeypatch, path="/health")[0] == 200  # other routes are not touched


# ------------------------------------------------------------------------- a served model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ternop.quant.convert import quantize_checkpoint

    root = tmp_path_factory.mktemp("serve")
    quant = root / "minilm-ternary"
    quantize_checkpoint(minilm_dir(), quant, progress=False)
    port = serve.free_port()
    cmd, env = serve.prepare(quant, port=port, served_model_name=MODEL, max_model_len=MAX_LEN, max_inputs=MAX_INPUTS,
                             max_body_bytes=MAX_BODY, max_queued_requests=MAX_QUEUED, extra=["--enforce-eager"])  # fmt: skip
    srv = serve.Server(cmd, env, root / "server.log", "127.0.0.1", port)
    with srv:
        srv.wait_ready(timeout=300)
        srv.quant = quant
        yield srv
    assert srv.proc is None


def _request(srv, body: bytes, path: str = "/v1/embeddings", timeout: float = 120.0) -> tuple[int, bytes]:
    host, port = srv.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _embed(srv, inputs, model=MODEL) -> tuple[int, dict]:
    status, raw = _request(srv, json.dumps({"model": model, "input": inputs}).encode())
    return status, json.loads(raw)


def _healthy(srv) -> bool:
    host, port = srv.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    finally:
        conn.close()


def _assert_serving(srv):
    assert _healthy(srv)
    status, body = _embed(srv, ["still serving"])
    assert status == 200 and len(body["data"][0]["embedding"]) == 384


@pytest.mark.vllm
@pytest.mark.slow
def test_serve_embeddings_match_ternary_reference(server):
    """What the server returns is the ternary model's embedding (HF model on TernaryLinear layers)."""
    from ternop.cli.evaluate import embed_hf_model

    texts = ["A ternary weight is one of -1, 0, +1.", "The cat sat on the mat."]
    status, body = _embed(server, texts)
    assert status == 200
    got = torch.tensor([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])])
    want, _ = embed_hf_model(server.quant, texts, torch.float32)
    torch.testing.assert_close(torch.nn.functional.normalize(got, dim=-1), want, atol=1e-4, rtol=1e-4)


def _load(srv, clients: int, requests_each: int, inputs_each: int) -> dict:
    """``clients`` threads, each sending ``requests_each`` requests in turn; statuses and latencies."""
    results: list[tuple[int, float, bytes]] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(c: int) -> None:
        start.wait()
        for r in range(requests_each):
            texts = [f"client {c} request {r} sentence {i} about ternary weights" for i in range(inputs_each)]
            t0 = time.perf_counter()
            try:
                status, raw = _request(srv, json.dumps({"model": MODEL, "input": texts}).encode())
            except OSError as e:  # a dropped connection is a failure, recorded as status 0
                status, raw = 0, repr(e).encode()
            with lock:
                results.append((status, time.perf_counter() - t0, raw))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    wall = time.perf_counter() - t0
    ok = [lat for status, lat, _ in results if status == 200]
    stats = {
        "requests": len(results), "ok": len(ok), "wall_s": wall,
        "statuses": {s: sum(1 for r in results if r[0] == s) for s in sorted({r[0] for r in results})},
        "req_per_s": len(ok) / wall, "inputs_per_s": len(ok) * inputs_each / wall,
        "p50_ms": 1e3 * statistics.median(ok) if ok else float("nan"),
        "p99_ms": 1e3 * statistics.quantiles(ok, n=100)[98] if len(ok) >= 2 else float("nan"),
    }  # fmt: skip
    print(f"\nload: {clients} clients x {requests_each} requests x {inputs_each} inputs: {stats['statuses']}, "
          f"{stats['req_per_s']:.1f} req/s, {stats['inputs_per_s']:.0f} inputs/s, "
          f"p50 {stats['p50_ms']:.0f} ms, p99 {stats['p99_ms']:.0f} ms, wall {wall:.1f} s")  # fmt: skip
    stats["results"] = results
    return stats


def _assert_clean(stats, inputs_each: int) -> None:
    assert stats["requests"] == stats["statuses"].get(200, 0) + stats["statuses"].get(429, 0) + stats[
        "statuses"
    ].get(503, 0), f"a request neither succeeded nor got a clean 429/503: {stats['statuses']}"
    for status, _, raw in stats["results"]:
        body = json.loads(raw)
        if status == 200:
            assert len(body["data"]) == inputs_each and len(body["data"][0]["embedding"]) == 384
        else:
            assert body["error"]["message"], body


@pytest.mark.vllm
@pytest.mark.slow
def test_serve_load_100_clients(server):
    """100 concurrent clients within capacity: every request succeeds, nothing is dropped or refused."""
    stats = _load(server, clients=100, requests_each=3, inputs_each=2)
    _assert_clean(stats, 2)
    # 100 clients x 2 inputs = 200 engine requests in flight at most: within the 256-request queue.
    assert stats["requests"] == 300 and stats["ok"] == 300, stats["statuses"]
    _assert_serving(server)


@pytest.mark.vllm
@pytest.mark.slow
def test_serve_overload_gets_clean_503(server):
    """100 clients x 16 inputs = 1600 requests in flight against a 256-request queue: the excess gets 503."""
    stats = _load(server, clients=100, requests_each=1, inputs_each=16)
    _assert_clean(stats, 16)
    if serve.supports_queue_cap():
        assert stats["statuses"].get(503, 0) > 0 and stats["ok"] > 0
    _assert_serving(server)


def _bad_inputs():
    ok = {"model": MODEL, "input": ["x"]}
    return {
        "over_long_text": json.dumps({"model": MODEL, "input": "ternary " * 2000}).encode(),
        "over_long_tokens": json.dumps({"model": MODEL, "input": [list(range(1000, 1000 + 4 * MAX_LEN))]}).encode(),
        "empty_list": json.dumps({"model": MODEL, "input": []}).encode(),
        "wrong_model": json.dumps({**ok, "model": "no-such-model"}).encode(),
        "malformed_json": b'{"model": "' + MODEL.encode() + b'", "input": ["x"',
        "non_utf8": b'{"model": "' + MODEL.encode() + b'", "input": ["\xff\xfe\xc3("]}',
        "wrong_type": json.dumps({"model": MODEL, "input": 5}).encode(),
        "not_an_object": b"[1, 2, 3]",
        "huge_batch": json.dumps({"model": MODEL, "input": ["word"] * 10 * MAX_INPUTS}).encode(),
        "huge_body": json.dumps({"model": MODEL, "input": ["word " * (MAX_BODY // 4)]}).encode(),
    }


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(_bad_inputs()))
def test_serve_bad_input_gets_4xx(server, case):
    body = _bad_inputs()[case]
    status, raw = _request(server, body)
    assert 400 <= status < 500, f"{case}: HTTP {status}: {raw[:300]!r}"
    payload = json.loads(raw)
    message = payload["error"]["message"] if "error" in payload else payload["detail"]
    assert message, f"{case}: no message in {payload}"
    print(f"\n{case}: HTTP {status}: {str(message)[:120]}")
    if case == "huge_batch":
        assert status == 413 and str(MAX_INPUTS) in message
    if case == "huge_body":
        assert status == 413 and str(MAX_BODY) in message
    if case in ("over_long_text", "over_long_tokens"):
        assert "maximum context length" in message
    _assert_serving(server)

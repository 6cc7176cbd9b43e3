"""Keeps CPython's freed frame-stack chunks for reuse, so that calls at a chunk edge stay cheap.

Since Python 3.11 the interpreter keeps each thread's Python frames in chunks of 16 KiB that it
maps when the stack grows past one and unmaps as soon as the stack shrinks back. A loop that
calls a function whose frame lands just past the end of a chunk therefore maps, touches (one
page fault) and unmaps a chunk on every call: about 6.5 us instead of 45 ns per call on
CPython 3.11 (``benchmarks/probe_stack_chunks.py``). CPython fixed this upstream by keeping one
chunk per thread (python/cpython#142183); the Pythons before that fix do not have it.

Where the edges fall depends on every frame below, so one engine process can hit an edge on a
hot path where another process running other code does not: in vLLM, the ternary embedder's
engine took one page fault per layer and query in FlashAttention's KV-cache update and the
attention wrapper, and several times the bf16 engine's host time in those two functions
(docs/VLLM_SPEED.md).

:func:`keep_stack_chunks` installs, process-wide, an arena allocator (CPython's public
``PyObject_SetArenaAllocator``) that keeps up to 8 freed blocks of at most 64 KiB and hands
them out again; larger blocks (pymalloc's 1 MiB arenas) pass straight to the allocator it
replaces. Nothing else changes: the interpreter initialises a chunk it receives, it never
relies on fresh memory being zero. The allocator is a few lines of C, compiled on the first
call with the C compiler Python was built with and cached under ``$TERNOP_HOST_CACHE``
(default ``~/.cache/ternop/host``). The plugin installs it in every vLLM process unless
``TERNOP_KEEP_STACK_CHUNKS=0``: on the H200 it removed the ternary embedder's 28 page faults per
query and brought its throughput from 0.88x and 0.84x of bf16 to 0.96x and 1.02x in the same run
(docs/VLLM_SPEED.md). It imports nothing of vLLM, so any long-running Python server can call it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

ENV_CACHE = "TERNOP_HOST_CACHE"
ENV_ENABLE = "TERNOP_KEEP_STACK_CHUNKS"

_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Freed arena blocks of at most LARGEST bytes (CPython's frame-stack chunks are 16 KiB) are kept,
   up to MAX_KEPT, and handed out again for a request of the same size. Called with the GIL held,
   as every arena allocation is in a build with a GIL. */
#define MAX_KEPT 8
#define LARGEST (64 * 1024)

static PyObjectArenaAllocator previous;
static void *kept[MAX_KEPT];
static size_t kept_size[MAX_KEPT];
static int n_kept = 0;
static int installed = 0;
static unsigned long long reused = 0, fresh = 0;

static void *keeping_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (size <= LARGEST) {
        for (int i = n_kept - 1; i >= 0; --i) {
            if (kept_size[i] == size) {
                void *block = kept[i];
                --n_kept;
                kept[i] = kept[n_kept];
                kept_size[i] = kept_size[n_kept];
                ++reused;
                return block;
            }
        }
        ++fresh;
    }
    return previous.alloc(previous.ctx, size);
}

static void keeping_free(void *ctx, void *block, size_t size) {
    (void)ctx;
    if (block != NULL && size <= LARGEST && n_kept < MAX_KEPT) {
        kept[n_kept] = block;
        kept_size[n_kept] = size;
        ++n_kept;
        return;
    }
    previous.free(previous.ctx, block, size);
}

int ternop_keep_stack_chunks(void) {
    if (installed) return 0;
    PyObjectArenaAllocator mine = {NULL, keeping_alloc, keeping_free};
    PyObject_GetArenaAllocator(&previous);
    PyObject_SetArenaAllocator(&mine);
    installed = 1;
    return 1;
}

unsigned long long ternop_stack_chunks_reused(void) { return reused; }
unsigned long long ternop_stack_chunks_fresh(void) { return fresh; }
"""

_lib: ctypes.PyDLL | None = None


def applies() -> tuple[bool, str]:
    """Whether this Python has the chunked frame stack that the fix is for, and why not if not."""
    if sys.implementation.name != "cpython":
        return False, f"{sys.implementation.name} is not CPython"
    if sys.version_info < (3, 11):
        return False, f"Python {sys.version_info.major}.{sys.version_info.minor} has no chunked frame stack (3.11+)"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return False, "a free-threaded build: its arena allocations may run without the GIL this allocator relies on"
    return True, ""


def _build() -> Path:
    include = sysconfig.get_paths()["include"]
    tag = hashlib.sha256((_SOURCE + sys.version + include).encode()).hexdigest()[:16]
    root = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "ternop" / "host")
    lib = root / tag / "stack_chunks.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    src = lib.parent / "stack_chunks.c"
    src.write_text(_SOURCE)
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    tmp = lib.parent / f"stack_chunks.{os.getpid()}.so"
    cmd = [*cc, "-shared", "-fPIC", "-O2", f"-I{include}", str(src), "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"ternop.stack_chunks: could not run the C compiler ({' '.join(cmd)}): {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(
            f"ternop.stack_chunks: compiling the allocator failed ({' '.join(cmd)}):\n{done.stderr.strip()[-2000:]}"
        )
    os.replace(tmp, lib)  # atomic: a concurrent process sees the whole library or none
    return lib


def keep_stack_chunks() -> bool:
    """Installs the allocator in this process. True if it was installed now, False if it
    already was or does not apply (:func:`applies`). Raises RuntimeError, naming the command,
    if the allocator cannot be compiled, and OSError if the compiled library does not load."""
    global _lib
    ok, _ = applies()
    if not ok:
        return False
    if _lib is None:
        _lib = ctypes.PyDLL(str(_build()))  # PyDLL: the calls keep the GIL
        _lib.ternop_stack_chunks_reused.restype = ctypes.c_ulonglong
        _lib.ternop_stack_chunks_fresh.restype = ctypes.c_ulonglong
    return bool(_lib.ternop_keep_stack_chunks())


def stats() -> dict | None:
    """{"reused": blocks handed out again, "fresh": small blocks that had to be mapped}, or None
    if the allocator is not installed in this process."""
    if _lib is None:
        return None
    return {"reused": int(_lib.ternop_stack_chunks_reused()), "fresh": int(_lib.ternop_stack_chunks_fresh())}


def enabled_by_env() -> bool:
    """True unless ``TERNOP_KEEP_STACK_CHUNKS`` is 0 (or false/no/off); unset or empty means on."""
    return os.environ.get(ENV_ENABLE, "").strip().lower() not in ("0", "false", "no", "off")

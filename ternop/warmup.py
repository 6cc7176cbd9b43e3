"""Building a layer's kernels before it serves, instead of on the request that first needs them.

Triton compiles a kernel the first time a launch needs it: once for each set of compile-time
constants (the tile of M's bucket, the slices of K) and for each class of an integer argument
(M = 1, M a multiple of 16, any other M). Which of those a call needs follows its batch size M.
An engine's own warm-up and its CUDA-graph capture run some batch sizes; a request whose M
reaches a variant that none of them ran waits for the compiler. In a vLLM decode run on the
H200 one such request took 0.83 s instead of 0.07 (docs/VLLM_SPEED.md).

:func:`warm_up` asks the registry which backend and which variant (``Backend.variant``) every
batch size a layer can see would run, and runs ``ternop::linear`` once for each variant, at the
smallest M that reaches it. A kernel already in Triton's on-disk cache loads instead of compiling,
so a machine pays the compilation on its first start only. The vLLM plugin calls it for each
distinct layer after loading (``TERNOP_WARMUP=0`` skips it).

The batch sizes asked are :func:`sample_ms`: every M up to 512, then each multiple of 16 and the
M after it, and the edges of the dispatcher's host-time rules. Tiles and buckets change only at
multiples of 16 (every tile's M is a multiple of 16), so each stretch between two multiples
holds at most one bucket, one tile count and one split of K, which those two Ms both see.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterable

import torch

from ternop import backends

logger = logging.getLogger("ternop")

ENV_WARMUP = "TERNOP_WARMUP"
EVERY_M_UP_TO = 512

_WARMED: set[tuple] = set()


def enabled() -> bool:
    """Whether the warm-up runs: TERNOP_WARMUP unset or anything but "0"."""
    return os.environ.get(ENV_WARMUP, "").strip() != "0"


def sample_ms(max_m: int, edges: Iterable[int] = ()) -> list[int]:
    """The batch sizes asked for M = 1..max_m (see the module's docstring); ``edges`` are Ms where
    a rule of the dispatcher changes its answer (``configs.host_rule_edges`` gives each with the M
    after it), added where they fit."""
    if max_m < 1:
        raise ValueError(f"max_m={max_m}: expected at least 1 token")
    ms = set(range(1, min(max_m, EVERY_M_UP_TO) + 1))
    for m in range(16, max_m + 1, 16):
        ms.update((m, m + 1))
    ms.update(edges)
    ms.add(max_m)
    return sorted(m for m in ms if 1 <= m <= max_m)


def plan(make_call: Callable[[int], backends.LinearCall], ms: Iterable[int]) -> list[tuple[int, str, tuple]]:
    """(M, backend, variant) for each distinct (backend, variant) the calls ``make_call(M)`` reach
    over ``ms``, at the first M that reaches it."""
    seen: dict[tuple, int] = {}
    out = []
    for m in ms:
        call = make_call(m)
        backend = backends.select(call)
        key = (backend.name, backend.variant(call))
        if key not in seen:
            seen[key] = m
            out.append((m, backend.name, key[1]))
    return out


def warm_up(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation_bits: int = 16,
    layout: str = "v1",
    dtype: torch.dtype = torch.bfloat16,
    max_m: int = 8192,
) -> list[tuple[int, str, tuple]]:
    """Runs ``ternop::linear`` on this layer once for each kernel variant that x [M, K] in ``dtype``
    reaches for M = 1..max_m (sampled, see :func:`sample_ms`); returns what it ran, as :func:`plan`.

    Only CUDA layers are warmed (the CPU backends compile nothing), and each kind of layer once per
    process: two layers of the same shape, dtypes, bias, layout and scale form run the same
    kernels. With int8 activations x is quantized inside the op, which runs every kernel that a
    call of ``ternop::linear_q8`` runs as well, but for the Triton int8 kernel where it starts early
    after that quantization (``configs.triton_a8_starts_early``): there ``ternop::linear_q8`` runs
    too. The inputs are zeros and the results are dropped.
    """
    from ternop import ops
    from ternop.meta import check_linear_inputs

    device = weight_packed.device
    if device.type != "cuda":
        return []
    from ternop.cuda import configs, registry

    n, k = weight_packed.shape[0], weight_packed.shape[1] * 4
    row = weight_scale.shape[1] == 1
    kind = (device, n, k, dtype, None if bias is None else bias.dtype, activation_bits, layout, row, max_m,
            configs.graph_max_m())  # fmt: skip
    if kind in _WARMED:
        return []
    start = time.perf_counter()
    x = torch.zeros((max_m, k), dtype=dtype, device=device)
    check_linear_inputs(x[:1], weight_packed, weight_scale, bias, activation_bits, layout)  # names what is wrong
    ms = sample_ms(max_m, configs.host_rule_edges(n, k))
    steps = plan(lambda m: ops.linear_call(x[:m], weight_packed, weight_scale, bias, activation_bits, layout), ms)
    for m, _, variant in steps:
        torch.ops.ternop.linear(x[:m], weight_packed, weight_scale, bias, activation_bits, layout)
        if registry.EARLY in variant:  # linear_q8 runs this kernel launched plainly: another compile
            q = torch.zeros((m, k), dtype=torch.int8, device=device)
            x_scale = torch.ones((m,), dtype=torch.float32, device=device)
            torch.ops.ternop.linear_q8(q, x_scale, weight_packed, weight_scale, bias, dtype, layout)
    torch.cuda.synchronize(device)
    del x
    torch.cuda.empty_cache()  # the engine sizes its caches after loading: leave it the memory
    _WARMED.add(kind)
    logger.info("ternop: ran the %d kernel variants of a %d x %d layer (%s, activation_bits=%d) for M <= %d in %.1f s",
                len(steps), n, k, layout, activation_bits, max_m, time.perf_counter() - start)  # fmt: skip
    return steps

"""The backend registry: which implementation runs one call of ``ternop::linear``.

A call is a ``LinearCall``: the real 2-D ``x [M, K]`` (unit stride along K), the weights,
the bias, the activation mode and the weight layout. Each backend answers
``can_implement(call) -> (ok, reason)``; the first backend in priority order that says yes
runs. ``TERNOP_BACKEND=<name>`` forces one backend; if it cannot run the call, the call
fails with its reason instead of silently falling back. ``TERNOP_SKIP_BACKENDS=<name>,...``
takes backends out of the walk (to compare two, or to step around one); it is read when a
call key is first seen, like the choice it changes.

The choice is made inside the op at run time, so a graph traced once with a symbolic M
(as vLLM does) still picks the right kernel for every batch size. The answer depends only
on the call's ``key`` (device, dtypes, shape, alignment, mode, layout), so it is cached
per key: a served model pays the walk through the registry once per batch size. It never
depends on whether a CUDA graph is being captured: a captured call takes what the same call
took eagerly, whose kernels are then already loaded.

The op's entry (``ternop.ops``) keys its calls by their own signature instead (every property
of the argument tensors that its checks and ``key`` read), so that a call seen before skips the
checks and the key: ``cached(signature)`` is the backend such a call took, or None.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

logger = logging.getLogger("ternop")

ENV_BACKEND = "TERNOP_BACKEND"
ENV_SKIP = "TERNOP_SKIP_BACKENDS"


class LinearCall(NamedTuple):
    """One call of ternop::linear, as the backends see it.

    x: [M, K] fp16/bf16/fp32 with x.stride(1) == 1 (x.stride(0) may exceed K);
    weight_packed: uint8 [N, K/4] contiguous, in ``layout`` (ternop.layouts);
    weight_scale: fp16 [N, K/128] contiguous, or [N, 1] (a scale per row) when activation_bits
    is 8 (the op expands a row scale for 16-bit activations); bias: [N] in x's dtype (any stride) or None;
    activation_bits: 16 (x as given) or 8 (x quantized per token to int8).

    A call of ``ternop::linear_q8`` arrives already quantized: x is the int8 q [M, K],
    ``x_scale`` its fp32 token scales [M] and ``out_dtype`` the output's dtype (and the bias's);
    activation_bits is 8. Otherwise both are None and the output has x's dtype.
    """

    x: torch.Tensor
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None
    activation_bits: int = 16
    layout: str = "v1"
    x_scale: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None

    @property
    def quantized(self) -> bool:
        """Whether x arrives as int8 rows with their scales (``ternop::linear_q8``)."""
        return self.x_scale is not None

    @property
    def dtype(self) -> torch.dtype:
        """The output's dtype."""
        return self.out_dtype if self.out_dtype is not None else self.x.dtype

    @property
    def m(self) -> int:
        return self.x.shape[0]

    @property
    def n(self) -> int:
        return self.weight_packed.shape[0]

    @property
    def k(self) -> int:
        return self.x.shape[1]

    @property
    def row_scales(self) -> bool:
        """Whether the weights have one scale per row (``weight_scale`` [N, 1])."""
        return self.weight_scale.shape[1] == 1

    def key(self) -> tuple:
        """Everything a backend's answer may depend on."""
        x, w = self.x, self.weight_packed
        m, k = x.shape
        return (
            x.device, x.dtype, m, w.shape[0], k, x.stride(0),
            x.data_ptr() % 16, w.data_ptr() % 16, self.bias is None, self.activation_bits, self.layout,
            self.row_scales,
            self.out_dtype,
        )


CanImplement = Callable[[LinearCall], "tuple[bool, str]"]
Run = Callable[[LinearCall], torch.Tensor]
Variant = Callable[[LinearCall], tuple]


def no_variant(call: LinearCall) -> tuple:
    """The variant of a backend whose kernels are built once for every call it takes."""
    return ()


@dataclass(frozen=True)
class Backend:
    """One implementation of ternop::linear.

    ``run(call)`` returns a new ``[M, N]`` tensor in x's dtype. Lower ``priority`` is tried first.
    ``variant(call)`` names the compiled kernels the call runs, beyond the call's key: two calls of
    one layer with the same backend and variant run kernels that were compiled once, for either
    (a JIT-compiled kernel is built anew for each tile, split of K or class of M; ``ternop.warmup``
    builds each before serving).
    """

    name: str
    device_type: str
    priority: int
    can_implement: CanImplement
    run: Run
    variant: Variant = no_variant


_BACKENDS: dict[str, Backend] = {}
_ORDER: dict[str, list[Backend]] = {}
_LOGGED: set[tuple[str, str]] = set()
_CHOICE: dict[tuple, Backend] = {}
# Past this many cached choices the cache starts over, so that a long-running server that sees
# every batch size up to its token budget on every layer shape keeps it under about 16 MB (an
# entry keyed by the op's signature takes about 1 KB).
MAX_CACHED_CHOICES = 1 << 14


def register(backend: Backend) -> None:
    """Adds or replaces a backend (registration is idempotent by name)."""
    _BACKENDS[backend.name] = backend
    _ORDER.clear()
    _CHOICE.clear()


def get(name: str) -> Backend:
    """The registered backend called ``name``; KeyError names the registered ones."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"no backend {name!r}; registered: {sorted(_BACKENDS)}") from None


def available(device_type: str | None = None) -> list[Backend]:
    """Registered backends, in the order they are tried."""
    key = device_type or "*"
    if key not in _ORDER:
        _ORDER[key] = sorted(
            (b for b in _BACKENDS.values() if device_type is None or b.device_type == device_type),
            key=lambda b: (b.priority, b.name),
        )
    return _ORDER[key]


def explain(call: LinearCall) -> list[tuple[str, bool, str]]:
    """For each backend of x's device: (name, ok, reason). For debugging and logs."""
    return [(b.name, *b.can_implement(call)) for b in available(call.x.device.type)]


def _forced(name: str, call: LinearCall) -> Backend:
    backend = _BACKENDS.get(name)
    if backend is None:
        raise RuntimeError(f"{ENV_BACKEND}={name!r} names no backend; registered: {sorted(_BACKENDS)}")
    if backend.device_type != call.x.device.type:
        raise RuntimeError(f"{ENV_BACKEND}={name!r} runs on {backend.device_type}, but x is on {call.x.device}")
    ok, reason = backend.can_implement(call)
    if not ok:
        raise RuntimeError(f"{ENV_BACKEND}={name!r} cannot run this call: {reason}")
    return backend


@contextlib.contextmanager
def forcing(name: str | None):
    """Runs the block as if ``TERNOP_BACKEND=name`` were set (unset when ``name`` is None), and
    restores the variable's previous state after it, also on error. Like the variable, a forced
    backend lifts the speed rules (M floors, tile-count rules) but not what its kernel cannot run."""
    saved = os.environ.get(ENV_BACKEND)
    if name is None:
        os.environ.pop(ENV_BACKEND, None)
    else:
        os.environ[ENV_BACKEND] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_BACKEND, None)
        else:
            os.environ[ENV_BACKEND] = saved


def skipped() -> set[str]:
    """The backend names that TERNOP_SKIP_BACKENDS lists."""
    return {name.strip() for name in os.environ.get(ENV_SKIP, "").split(",") if name.strip()}


def cached(key: tuple) -> Backend | None:
    """The backend cached under ``key`` (one that ``select(call, key)`` was given), or None: if
    none is, or if ``TERNOP_BACKEND`` forces one (a forced backend is never cached)."""
    if os.environ.get(ENV_BACKEND):
        return None
    return _CHOICE.get(key)


def select(call: LinearCall, key: tuple | None = None) -> Backend:
    """The backend that runs this call. Raises RuntimeError with every rejection reason if none can.

    The choice is cached under ``key``, by default ``call.key()``. A caller's own key must
    determine everything ``call.key()`` holds, and must not collide with the form of ``call.key()``.
    """
    forced = os.environ.get(ENV_BACKEND)
    if forced:
        return _forced(forced, call)
    if key is None:
        key = call.key()
    backend = _CHOICE.get(key)
    if backend is not None:
        return backend
    reasons = []
    skip = skipped()
    unknown = skip - set(_BACKENDS)
    if unknown:
        raise RuntimeError(f"{ENV_SKIP} names no backend {sorted(unknown)}; registered: {sorted(_BACKENDS)}")
    for backend in available(call.x.device.type):
        if backend.name in skip:
            reasons.append(f"{backend.name}: skipped ({ENV_SKIP})")
            continue
        ok, reason = backend.can_implement(call)
        if ok:
            if len(_CHOICE) >= MAX_CACHED_CHOICES:
                _CHOICE.clear()
            _CHOICE[key] = backend
            return backend
        reasons.append(f"{backend.name}: {reason}")
        if (backend.name, reason) not in _LOGGED:
            _LOGGED.add((backend.name, reason))
            logger.debug("ternop backend %s not chosen: %s", backend.name, reason)
    x = call.x
    raise RuntimeError(
        f"ternop.linear: no backend can run x {tuple(x.shape)} {x.dtype} on {x.device} "
        f"(activation_bits={call.activation_bits}, layout={call.layout!r})"
        + ("; " + "; ".join(reasons) if reasons else " (no backend is registered for this device)")
    )


def clear_cache() -> None:
    """Forgets the cached choices (after changing a config table, for example)."""
    _CHOICE.clear()

"""The backend registry: which implementation runs one call of ``ternop::linear``.

Each backend answers ``can_implement(x2, weight_packed, weight_scale, bias) -> (ok, reason)``
for the real, 2-D, contiguous ``x2 [M, K]`` of this call. The first backend in priority
order that says yes runs. ``TERNOP_BACKEND=<name>`` forces one backend; if it cannot run
this call, the call fails with its reason instead of silently falling back.

The choice is made inside the op at run time, so a graph traced once with a symbolic M
(as vLLM does) still picks the right kernel for every batch size.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger("ternop")

ENV_BACKEND = "TERNOP_BACKEND"

CanImplement = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], "tuple[bool, str]"]
Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class Backend:
    """One implementation of ternop::linear on 2-D contiguous input.

    ``run(x2 [M, K], weight_packed uint8 [N, K/4], weight_scale fp16 [N, K/128], bias [N] | None)``
    returns a new ``[M, N]`` tensor in x2's dtype. Lower ``priority`` is tried first.
    """

    name: str
    device_type: str
    priority: int
    can_implement: CanImplement
    run: Run


_BACKENDS: dict[str, Backend] = {}
_ORDER: dict[str, list[Backend]] = {}
_LOGGED: set[tuple[str, str]] = set()


def register(backend: Backend) -> None:
    """Adds or replaces a backend (registration is idempotent by name)."""
    _BACKENDS[backend.name] = backend
    _ORDER.clear()


def available(device_type: str | None = None) -> list[Backend]:
    """Registered backends, in the order they are tried."""
    key = device_type or "*"
    if key not in _ORDER:
        _ORDER[key] = sorted(
            (b for b in _BACKENDS.values() if device_type is None or b.device_type == device_type),
            key=lambda b: (b.priority, b.name),
        )
    return _ORDER[key]


def explain(x2: torch.Tensor, weight_packed, weight_scale, bias=None) -> list[tuple[str, bool, str]]:
    """For each backend of x2's device: (name, ok, reason). For debugging and logs."""
    return [(b.name, *b.can_implement(x2, weight_packed, weight_scale, bias)) for b in available(x2.device.type)]


def select(x2: torch.Tensor, weight_packed, weight_scale, bias=None) -> Backend:
    """The backend that runs this call. Raises RuntimeError with every rejection reason if none can."""
    forced = os.environ.get(ENV_BACKEND)
    if forced:
        backend = _BACKENDS.get(forced)
        if backend is None:
            raise RuntimeError(
                f"{ENV_BACKEND}={forced!r} names no backend; registered: {sorted(_BACKENDS)}"
            )
        if backend.device_type != x2.device.type:
            raise RuntimeError(
                f"{ENV_BACKEND}={forced!r} runs on {backend.device_type}, but x is on {x2.device}"
            )
        ok, reason = backend.can_implement(x2, weight_packed, weight_scale, bias)
        if not ok:
            raise RuntimeError(f"{ENV_BACKEND}={forced!r} cannot run this call: {reason}")
        return backend
    reasons = []
    for backend in available(x2.device.type):
        ok, reason = backend.can_implement(x2, weight_packed, weight_scale, bias)
        if ok:
            return backend
        reasons.append(f"{backend.name}: {reason}")
        if (backend.name, reason) not in _LOGGED:
            _LOGGED.add((backend.name, reason))
            logger.debug("ternop backend %s not chosen: %s", backend.name, reason)
    raise RuntimeError(
        f"ternop.linear: no backend can run x {tuple(x2.shape)} {x2.dtype} on {x2.device}"
        + ("; " + "; ".join(reasons) if reasons else " (no backend is registered for this device)")
    )

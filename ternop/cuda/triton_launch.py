"""Launching ternop's Triton kernels with less host work per call.

``kernel[grid](*args, **options)`` makes Triton bind every argument, derive the kernel's
specialization from them and hash a cache key, on every call, before the launch itself. On the
H200's host that costs tens of microseconds a launch: ``ternop::linear_q8`` at 16384 tokens took
about 150 us of host time against about 22 us for ``F.linear`` (``benchmarks/probe_host_call.py
--a8``), and above 512 tokens vLLM runs its layers eagerly, so each step pays it for every linear.

``FastLaunch(kernel)`` keeps, under a key of its own, the compiled kernel that Triton's own path
returned the first time, and afterwards hands the arguments straight to that kernel's launcher.
The key holds everything Triton specializes on, so it is never coarser than Triton's:

- each tensor argument's dtype and whether its address is a multiple of 16;
- each integer's width (32 or 64 bits, signed or not), whether it is a multiple of 16 and
  whether it is 1;
- the exact value of every other argument (the constexprs, None, floats, bools);
- the launch options (``num_warps``, ``num_stages``, ``enable_fp_fusion``, ...) and the device.

A key not seen before always goes through ``kernel[grid]`` (compiling where needed), so the
kernel launched directly is one Triton chose for the same key. Under ``TRITON_INTERPRET=1``, or
with a Triton whose compiled kernels do not offer the launcher used here, every call takes
Triton's own path; so does every call while ``TERNOP_TRITON_DIRECT_LAUNCH=0`` is set (read once,
at import), the way back should a Triton release change what its compiled kernels take.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

try:  # what Triton itself asks for the stream (the current CUDA stream of a device, as a handle)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # a build without CUDA: no kernel is ever launched directly there

    def _raw_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


ENV_DIRECT = "TERNOP_TRITON_DIRECT_LAUNCH"
DIRECT = os.environ.get(ENV_DIRECT, "1") != "0"

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def _spec(value: Any) -> Any:
    """What Triton's specialization may depend on, for one non-constexpr argument."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return (type(value), value)
    width = 32 if _I32[0] <= value < _I32[1] else 64 if _I64[0] <= value < _I64[1] else 65
    return (int, width, value % 16 == 0, value == 1)


class FastLaunch:
    """``FastLaunch(kernel)[grid](*args, **kwargs)``, called as the kernel would be: parameters
    positionally or by name, launch options (``num_warps``, ...) by name."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.direct = DIRECT and isinstance(kernel, JITFunction)
        if self.direct:
            self.names = list(kernel.arg_names)
            self.defaults = [p.default for p in kernel.params]
            self.constexprs = frozenset(kernel.constexprs)
        self.compiled: dict[tuple, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(every parameter's value in signature order, the launch options)."""
        values = list(args)
        options = dict(kwargs)
        for name, default in zip(self.names[len(args) :], self.defaults[len(args) :]):
            if name in options:
                values.append(options.pop(name))
            elif default is not inspect.Parameter.empty:
                values.append(default)
            else:
                raise TypeError(f"{self.kernel.__name__}() missing the argument {name!r}")
        return tuple(values), options

    def key(self, values: tuple, options: dict) -> tuple:
        """The key of a call on the current device, less the device."""
        spec = tuple(v if i in self.constexprs else _spec(v) for i, v in enumerate(values))
        return spec, tuple(sorted(options.items()))

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if not self.direct:
            self.kernel[grid](*args, **kwargs)
            return
        values, options = self.bind(args, kwargs)
        device = torch.cuda.current_device()
        key = (device, *self.key(values, options))
        compiled = self.compiled.get(key)
        if compiled is None:  # Triton's own path, which compiles where it must
            compiled = self.kernel[grid](*values, **options)
            if hasattr(compiled, "run") and hasattr(compiled, "packed_metadata"):
                self.compiled[key] = compiled
            return
        hooks = triton.knobs.runtime
        enter, exit_ = hooks.launch_enter_hook, hooks.launch_exit_hook
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        stream = _raw_stream(device)
        metadata = compiled.launch_metadata(grid, stream, *values)  # as Triton's path (None without hooks)
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, metadata, enter, exit_, *values)

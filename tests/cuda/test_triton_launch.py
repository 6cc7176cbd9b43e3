"""FastLaunch (ternop/cuda/triton_launch.py) without a GPU: its key, its binding of arguments,
and when it launches directly or through Triton's own path. The kernel is a real JITFunction
whose Triton path is replaced by a recorder, and the compiled kernel a fake that records its
launcher's arguments; on a GPU, tests/cuda/test_linear_cuda.py runs the real launches."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _kernel_source(a_ptr, b_ptr, n, stride, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = True):  # noqa: F821
    pass


class _Compiled:
    """What Triton's path returns: a compiled kernel with a launcher."""

    def __init__(self, log):
        self.log = log
        self.function = "fn-handle"
        self.packed_metadata = "meta"

    def run(self, *args):
        self.log.append(("direct", args))

    def launch_metadata(self, grid, stream, *args):
        return None


@pytest.fixture()
def launcher(monkeypatch):
    from triton.runtime.jit import JITFunction

    from ternop.cuda import triton_launch

    log = []

    class RecordingJIT(JITFunction):
        def __getitem__(self, grid):
            def run(*args, **options):
                log.append(("triton", grid, args, options))
                return _Compiled(log)

            return run

    monkeypatch.setattr(triton_launch, "DIRECT", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_raw_stream", lambda device: 1234)
    return triton_launch.FastLaunch(RecordingJIT(_kernel_source)), log


def test_spec_separates_what_triton_specializes_on():
    from ternop.cuda.triton_launch import _spec

    assert _spec(16) != _spec(17)  # divisibility by 16
    assert _spec(1) != _spec(3)  # the value 1
    assert _spec(3) == _spec(5)
    assert _spec(2**31 + 16) != _spec(16)  # 64-bit integers
    assert _spec(2**63 + 16) != _spec(2**31 + 16)  # unsigned 64-bit
    assert _spec(True) != _spec(False)
    assert _spec(None) != _spec(0)
    aligned = torch.zeros(32, dtype=torch.float16)
    assert aligned.data_ptr() % 16 == 0
    assert _spec(aligned) != _spec(aligned[1:])  # 2 bytes past: no longer 16-byte aligned
    assert _spec(aligned) != _spec(aligned.view(torch.int16))  # dtype
    assert _spec(aligned[8:]) == _spec(aligned)  # 16 bytes past


def test_bind_orders_names_applies_defaults_and_refuses_missing(launcher):
    fast, _ = launcher
    a, b = torch.zeros(8), torch.zeros(8)
    values, options = fast.bind((a,), {"b_ptr": b, "n": 8, "stride": 1, "BLOCK": 32, "num_warps": 4})
    assert values == (a, b, 8, 1, 32, True)
    assert options == {"num_warps": 4}
    with pytest.raises(TypeError, match="'BLOCK'"):
        fast.bind((a, b, 8, 1), {})


def test_first_call_of_a_key_goes_through_triton_then_direct(launcher):
    import triton

    fast, log = launcher
    a, b = torch.zeros(8), torch.zeros(8)
    fast[(3,)](a, b, 8, 3, BLOCK=32, num_warps=4)
    assert [e[0] for e in log] == ["triton"]
    assert log[0][2] == (a, b, 8, 3, 32, True) and log[0][3] == {"num_warps": 4}

    fast[(5, 2)](a, b, 24, 5, BLOCK=32, num_warps=4)  # same key: ints neither 1 nor multiples of 16
    assert [e[0] for e in log] == ["triton", "direct"]
    hooks = triton.knobs.runtime
    enter, exit_ = hooks.launch_enter_hook, hooks.launch_exit_hook
    assert log[1][1] == (5, 2, 1, 1234, "fn-handle", "meta", None, enter, exit_, a, b, 24, 5, 32, True)


@pytest.mark.parametrize(
    "change",
    [
        lambda a, b: ((a, b, 16, 1), {"BLOCK": 32, "num_warps": 4}),  # n now a multiple of 16
        lambda a, b: ((a, b, 8, 3), {"BLOCK": 32, "num_warps": 4}),  # the stride no longer 1
        lambda a, b: ((a, b, 8, 1), {"BLOCK": 64, "num_warps": 4}),  # another constexpr
        lambda a, b: ((a, b, 8, 1), {"BLOCK": 32, "FLAG": False, "num_warps": 4}),  # a defaulted constexpr
        lambda a, b: ((a, b, 8, 1), {"BLOCK": 32, "num_warps": 8}),  # a launch option
        lambda a, b: ((a[1:], b, 8, 1), {"BLOCK": 32, "num_warps": 4}),  # a pointer off 16 bytes
        lambda a, b: ((a.half(), b, 8, 1), {"BLOCK": 32, "num_warps": 4}),  # a pointer's dtype
    ],
)
def test_a_new_key_goes_through_triton_again(launcher, change):
    fast, log = launcher
    a, b = torch.zeros(8), torch.zeros(8)
    fast[(3,)](a, b, 8, 1, BLOCK=32, num_warps=4)
    args, kwargs = change(a, b)
    fast[(3,)](*args, **kwargs)
    assert [e[0] for e in log] == ["triton", "triton"]


def test_switched_off_every_call_takes_triton_path(launcher, monkeypatch):
    from ternop.cuda import triton_launch

    fast, log = launcher
    monkeypatch.setattr(triton_launch, "DIRECT", False)
    fast = triton_launch.FastLaunch(fast.kernel)
    a, b = torch.zeros(8), torch.zeros(8)
    for _ in range(2):
        fast[(3,)](a, b, 8, 1, BLOCK=32)
    assert [e[0] for e in log] == ["triton", "triton"]

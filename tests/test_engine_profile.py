"""benchmarks/engine_profile.py profiles the process it runs in between start() and stop(), and
bench_vllm.py refuses the options that need the engine on the calling thread when it is not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import engine_profile  # noqa: E402


def test_stop_summarises_what_ran_since_start():
    engine_profile.start()
    try:
        torch.randn(64, 64) @ torch.randn(64, 64)
    finally:
        out = engine_profile.stop(n=50, by="cpu")
    names = [row["name"] for row in out["top"]]
    assert "aten::mm" in names
    mm = out["top"][names.index("aten::mm")]
    assert mm["calls"] == 1 and mm["self_us"] > 0
    assert out["self_us"] >= mm["self_us"]
    assert (out["device_busy_us"] is None) == (not torch.cuda.is_available())  # a GPU's time, where there is one
    # Nothing before start() is in the next profile.
    torch.randn(64, 64) @ torch.randn(64, 64)
    engine_profile.start()
    out = engine_profile.stop(n=50, by="cpu")
    assert "aten::mm" not in [row["name"] for row in out["top"]]


def test_start_and_stop_refuse_to_nest_or_to_stop_nothing():
    with pytest.raises(RuntimeError, match="no profile is running"):
        engine_profile.stop()
    engine_profile.start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            engine_profile.start()
    finally:
        engine_profile.stop()


@pytest.mark.parametrize("flags", [["--pyprofile"], ["--control-ternop"], ["--pyprofile", "--control-ternop"]])
def test_bench_vllm_refuses_in_process_options_with_a_separate_engine(flags, tmp_path):
    run = subprocess.run([sys.executable, str(BENCHMARKS / "bench_vllm.py"), *flags, "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2
    assert "--engine-process in-process" in run.stderr and all(f in run.stderr for f in flags)
    assert not (tmp_path / "x.json").exists()


class _InProcess:
    """An LLM whose apply_model runs the function here, as vLLM does with the engine in-process."""

    def apply_model(self, fn):
        return [fn(None)]


class _CannotSend:
    """An LLM that cannot send a function to its engine's process."""

    def apply_model(self, fn):
        raise TypeError("Object of type <class 'function'> is not serializable")


def test_profile_top_profiles_the_work_through_apply_model():
    import bench_vllm

    totals = {}
    rows = bench_vllm._profile_top(_InProcess(), lambda: torch.randn(64, 64) @ torch.randn(64, 64), n=50,
                                   by="cpu", totals=totals)  # fmt: skip
    assert "aten::mm" in [row["name"] for row in rows]
    assert totals["wall_us"] > 0 and totals["self_us"] > 0 and "device_busy_us" in totals


def test_profile_top_keeps_the_run_going_when_the_engine_cannot_profile():
    import bench_vllm

    ran, totals = [], {}
    assert bench_vllm._profile_top(_CannotSend(), lambda: ran.append(1), totals=totals) == []
    assert not ran and "did not start in the engine's process" in totals["error"]
    assert "not serializable" in totals["error"]


def test_graph_sizes_add_to_vllms_defaults_in_a_config_vllm_takes():
    """--graph-sizes: vLLM's default sizes up to 512 plus the given ones, each once, ascending, in
    the form vLLM's CompilationConfig accepts; without the option the engines keep vLLM's own."""
    import bench_vllm

    config = pytest.importorskip("vllm.config")
    sizes = bench_vllm._graph_config(bench_vllm._size_list("16384,1024,512"))["compilation_config"]
    got = config.CompilationConfig(**sizes).cudagraph_capture_sizes
    assert got == sorted(got) and len(set(got)) == len(got)
    assert got[:4] == [1, 2, 4, 8] and got[-4:] == [496, 512, 1024, 16384]
    assert bench_vllm._graph_config(None) == {}
    with pytest.raises(Exception, match="expected batch sizes"):
        bench_vllm._size_list("1024,0")

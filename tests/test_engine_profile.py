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

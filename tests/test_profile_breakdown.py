"""benchmarks/profile_breakdown.py sorts a decode profile's kernels as the docs' tables do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import profile_breakdown as pb  # noqa: E402


def _row(name, calls, self_us, host=0.0):
    return {"name": name, "calls": calls, "self_us": self_us, "self_cpu_us": host}


def test_breakdown_sorts_kernels_per_step():
    steps = 128
    profile = {"steps": steps, "top": [
        _row("void ternop::(anonymous namespace)::ternary_mma_a8_kernel<__nv_bfloat16, 1, false, 2>", 18288, 128000.0),
        _row("quant_rows_kernel", 9216, 12800.0),
        _row("rms_norm_quant_kernel", 15360, 25600.0),
        _row("nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", steps, 38400.0),  # the LM head: once a step
        _row("nvjet_sm90_tst_192x8_64x8_2x1_v_bz_TNT", 4572, 2560.0),  # a layer GEMM
        _row("aten::mm", steps, 38400.0, host=10000.0),  # host op: its kernel is the row above
        _row("triton_red_fused_fused_add_rms_norm_0", 4608, 1280.0),
        _row("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<", 4608, 3840.0),
        _row("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>", 4608, 1280.0),
        _row("_gumbel_sample_kernel", steps, 256.0),
        _row("fused_a8_kernel", 144, 4500.0),  # the prefill's 144 linears: once a run
        _row("nvjet_sm90_tst_192x16_64x8_2x1_v_bz_TNT", 36, 1800.0),  # prefill GEMM
    ]}
    b = pb.breakdown(profile)
    us = b["per_step_us"]
    assert us["ternop linears"] == pytest.approx(1000.0)
    assert us["ternop quantization and norms"] == pytest.approx(300.0)
    assert us["LM head (cuBLAS)"] == pytest.approx(300.0)
    assert us["layer linears (cuBLAS)"] == pytest.approx(20.0)
    assert us[pb.KINDS[4]] == pytest.approx(10.0)
    assert us["attention and KV-cache write"] == pytest.approx(40.0)
    assert us["sampling and other"] == pytest.approx(2.0)
    assert b["once_a_run_us"] == pytest.approx(6300.0)
    assert not any("aten::mm" in n for names in b["kernels"].values() for n in names)

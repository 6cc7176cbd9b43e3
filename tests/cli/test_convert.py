"""``ternop convert``: converts BitNet folders and GGUF files, says what it did, and fails with one line."""

from __future__ import annotations

import pytest

from ternop.checkpoint import read_quant_config
from ternop.cli import main
from tests.ternary_sources import tiny_bitnet, tiny_gguf

pytest.importorskip("transformers")


def test_convert_cli_bitnet(tmp_path, capsys):
    src = tiny_bitnet(tmp_path / "src", "bitlinear")
    assert main(["convert", str(src), str(tmp_path / "dst"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "HF BitNet, packed" in out and "quantized 14 linear layers, left 1 dense" in out
    assert "activation_bits 8: int8 activations per token" in out and "dense: lm_head" in out
    assert main(["convert", str(src), str(tmp_path / "dst"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "ternop convert: error: destination" in err and "--force" in err and "Traceback" not in err
    assert main(["convert", str(src), str(tmp_path / "dst"), "--quiet", "--force", "--activations", "fp"]) == 0
    assert read_quant_config(tmp_path / "dst")["activation_bits"] == 16


def test_convert_cli_gguf_and_errors(tmp_path, capsys):
    pytest.importorskip("gguf")
    path, _ = tiny_gguf(tmp_path / "g", "qwen2", "TQ1_0")
    assert main(["convert", str(path.parent), str(tmp_path / "dst"), "--quiet"]) == 0  # a folder holding one GGUF
    out = capsys.readouterr().out
    assert "GGUF (qwen2)" in out and "14 TQ1_0" in out and "activation_bits 16" in out
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "x"), "--quiet"]) == 2
    assert "ternop convert: error: source" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hi")
    assert main(["convert", str(tmp_path / "notes.txt"), str(tmp_path / "x"), "--quiet"]) == 2
    assert "not a .gguf file" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

"""The small artifact of a trained model: ternary layers + trained norms/biases, and the checkpoint rebuilt from it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ternop.quant import artifact


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    from tests.models import tiny_bert_wide, word_salad
    from ternop.quant.distill import DistillConfig, run

    root = tmp_path_factory.mktemp("artifact")
    base = tiny_bert_wide(root / "fp", seed=4)
    dst = root / "distilled"
    run(base, dst, word_salad(30, 8, seed=1), DistillConfig(steps=3, batch_size=4, init="optimal", quiet=True))
    return base, dst


def test_extract_keeps_only_what_training_changed(distilled):
    base, dst = distilled
    tensors, qc = artifact.extract(dst, base)
    assert qc["quant_method"] == "ternary"
    full = load_file(str(dst / "model.safetensors"))
    assert {n for n in full if n.endswith((".weight_packed", ".weight_scale"))} <= set(tensors)
    assert not any("embeddings" in n for n in tensors)
    assert any(n.endswith("LayerNorm.weight") for n in tensors)  # trained norms travel
    assert len(tensors) < len(full)


def test_assemble_rebuilds_the_checkpoint_exactly(distilled, tmp_path):
    base, dst = distilled
    tensors, qc = artifact.extract(dst, base)
    path = tmp_path / "model.safetensors"
    sha = artifact.save(tensors, qc, path)
    assert sha == artifact.sha256_of(path) and len(sha) == 64
    out = tmp_path / "rebuilt"
    assert artifact.assemble(path, base, out, sha256=sha) == qc
    a, b = load_file(str(dst / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads((dst / "config.json").read_text())["quantization_config"]


def test_assemble_refuses_an_altered_file(distilled, tmp_path):
    base, dst = distilled
    tensors, qc = artifact.extract(dst, base)
    path = tmp_path / "a.safetensors"
    sha = artifact.save(tensors, qc, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(artifact.ArtifactError, match="expected " + sha):
        artifact.assemble(path, base, tmp_path / "out", sha256=sha)
    assert not (tmp_path / "out").exists()
    with pytest.raises(artifact.ArtifactError, match="does not exist"):
        artifact.load(tmp_path / "missing.safetensors")


def test_artifact_must_fit_the_base(distilled, tmp_path):
    base, dst = distilled
    tensors, qc = artifact.extract(dst, base)
    name = next(n for n in tensors if n.endswith("LayerNorm.bias"))
    tensors[name] = torch.zeros(3)
    path = tmp_path / "bad.safetensors"
    artifact.save(tensors, qc, path)
    with pytest.raises(artifact.ArtifactError, match=name.replace(".", r"\.") + r" is \[3\]"):
        artifact.assemble(path, base, tmp_path / "out")
    with pytest.raises(artifact.ArtifactError, match="not a ternary checkpoint"):
        artifact.extract(base, base)

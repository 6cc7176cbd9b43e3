"""The demo's model: the committed artifact matches its pinned sha256 and rebuilds a valid checkpoint."""

from __future__ import annotations

import json

import pytest

from ternop.cli import demo
from ternop.quant import artifact


def test_committed_artifact_has_the_pinned_sha256_and_is_small():
    assert demo.ARTIFACT.is_file(), demo.ARTIFACT
    assert demo.ARTIFACT.stat().st_size <= 5 * 2**20
    assert artifact.sha256_of(demo.ARTIFACT) == demo.ARTIFACT_SHA256
    readme = (demo.ARTIFACT.parent / "README.md").read_text()
    assert demo.ARTIFACT_SHA256 in readme and "quality_minilm_gpu.py device JOB OUT" in readme


def test_artifact_assembles_with_the_fp32_package_into_an_all_ternary_checkpoint(tmp_path):
    from tests.models import minilm_dir

    from ternop.checkpoint import load_ternary_layers, read_quant_config
    from ternop.format import validate

    base = minilm_dir()
    dst = tmp_path / "minilm"
    qc = artifact.assemble(demo.ARTIFACT, base, dst, sha256=demo.ARTIFACT_SHA256)
    assert qc == read_quant_config(dst)
    assert [m for m in qc["modules_to_not_convert"] if m.startswith("encoder.")] == []
    layers = load_ternary_layers(dst)
    assert len(layers) == 36  # every encoder linear of the 6 layers
    for name, (packed, scale) in layers.items():
        validate(packed, scale, name)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "ternary"


def test_demo_refuses_an_altered_artifact(tmp_path):
    bad = tmp_path / "model.safetensors"
    data = bytearray(demo.ARTIFACT.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(artifact.ArtifactError, match="was altered"):
        artifact.load(bad, sha256=demo.ARTIFACT_SHA256)

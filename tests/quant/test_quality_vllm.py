"""Calibrated and distilled checkpoints load through the vLLM plugin and embed as they do in transformers."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_fp(tmp_path_factory):
    from tests.models import tiny_bert_wide

    return tiny_bert_wide(tmp_path_factory.mktemp("quality") / "fp", seed=3)


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    from tests.models import word_salad

    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text("\n".join(word_salad(32, 10, seed=1)) + "\n")
    return path


@pytest.fixture(scope="module")
def calibrated(tiny_fp, train_file, tmp_path_factory):
    from ternop.quant.convert import calibrated_quantizer, quantize_checkpoint

    dst = tmp_path_factory.mktemp("cal") / "ckpt"
    quantizer = calibrated_quantizer(tiny_fp, str(train_file), (), calib_tokens=1024, progress=False)
    quantize_checkpoint(tiny_fp, dst, method="calibrated", quantizer=quantizer, progress=False)
    return dst


@pytest.fixture(scope="module")
def distilled(tiny_fp, train_file, tmp_path_factory):
    from ternop.cli import distill

    dst = tmp_path_factory.mktemp("dist") / "ckpt"
    parser = argparse.ArgumentParser()
    distill.add_arguments(parser)
    args = parser.parse_args([str(tiny_fp), str(dst), "--data", str(train_file), "--steps", "8", "--batch-size", "8",
                              "--calib-tokens", "1024", "--lr", "2e-3", "--quiet"])  # fmt: skip
    assert distill.main(args) == 0
    return dst


@pytest.mark.parametrize("which", ["calibrated", "distilled"])
def test_quality_checkpoints_embed_in_vllm_as_in_hf(which, request):
    from tests.vllm_plugin._llm import assert_close_embeddings, reference_embed, vllm_embed

    path = request.getfixturevalue(which)
    got, methods = vllm_embed(path, eager=True)
    assert methods[0].get("TernaryLinearMethod") == 8  # 2 layers x (qkv, attn out, intermediate, out)
    assert_close_embeddings(got, reference_embed(path, "cls"))

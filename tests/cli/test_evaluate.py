"""``ternop eval``: the loader of ternary checkpoints into HF models, byte counts, gates, and the report."""

from __future__ import annotations

import json

import pytest
import torch

from ternop.cli import evaluate, memory
from ternop.quant.convert import quantize_checkpoint
from ternop.format import BLOCK_SIZE
from ternop.hf import build_layout, load_model
from tests.models import _vocab_tokenizer, tiny_bert, tiny_qwen3


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-bert")
    base = tiny_bert(root / "base")
    quant = root / "ternary"
    quantize_checkpoint(base, quant, method="absmean", progress=False)
    return base, quant


@pytest.fixture(scope="module")
def causal_pair(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("eval-causal")
    base = root / "base"
    _vocab_tokenizer(base)
    vocab = len((base / "vocab.txt").read_text().split("\n")) - 1
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3)  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(str(base), safe_serialization=True)
    quant = root / "ternary"
    quantize_checkpoint(base, quant, method="absmean", progress=False)
    return base, quant


def _run(argv: list[str]) -> int:
    """``ternop eval ARGV``, in this process, with the console script's error handling."""
    from ternop.cli import main

    return main(["eval", *argv])


def test_evaluate_loader_matches_dequantized_reference(bert_pair):
    """The TernaryLinear model computes what dense layers with the dequantized weights compute."""
    _, quant = bert_pair
    model = load_model(quant, causal=False)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "TernaryLinear" in kinds
    reference = load_model(quant, causal=False, dense=True)
    ids = torch.randint(5, 40, (2, 9))
    with torch.no_grad():
        got = model(input_ids=ids).last_hidden_state
        want = reference(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_memory_counts_a_vllm_layers_row_scales_as_linear_weights():
    """A vLLM linear layer (a LinearBase subclass) with int8 activations keeps its [N, 1] row
    scales as the buffer ``ternop_row_scale`` beside ``weight_packed`` and ``weight_scale``: all
    three are the layer's weight memory, and its other buffers are not."""

    class LinearBase(torch.nn.Module):  # the name is what memory recognises, without importing vLLM
        pass

    class RowParallelLinear(LinearBase):
        def __init__(self):
            super().__init__()
            self.weight_packed = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.uint8), requires_grad=False)
            self.weight_scale = torch.nn.Parameter(torch.ones(64, 2, dtype=torch.float16), requires_grad=False)
            self.register_buffer("ternop_row_scale", torch.ones(64, 1, dtype=torch.float16), persistent=False)
            self.register_buffer("other", torch.zeros(10, dtype=torch.float32))

    got = memory.weight_memory(RowParallelLinear())
    assert got["mem_linear"] == 64 * 64 + 64 * 2 * 2 + 64 * 2
    assert got["mem_total"] == got["mem_linear"] + 10 * 4


def test_evaluate_memory_counts_bytes_of_the_layout(bert_pair):
    base, quant = bert_pair
    names = list(build_layout(quant, causal=False).named_modules())
    ternary = [m for _, m in names if type(m).__name__ == "TernaryLinear"]
    weights = sum(m.in_features * m.out_features for m in ternary)
    left_dense = sum(m.weight.numel() for _, m in names if isinstance(m, torch.nn.Linear))  # e.g. the pooler
    assert left_dense > 0
    prefixes = [n for n, m in names if type(m).__name__ == "TernaryLinear"]
    got = memory.weight_memory(build_layout(quant, causal=False))
    dense = memory.weight_memory(build_layout(base, causal=False))
    # 2 bits per weight plus one fp16 scale per 128 weights, vs 4 bytes per fp32 weight.
    assert got["mem_linear"] == weights // 4 + weights // BLOCK_SIZE * 2 + left_dense * 4
    assert dense["mem_linear"] == (weights + left_dense) * 4
    assert dense["mem_total"] - got["mem_total"] == dense["mem_linear"] - got["mem_linear"]
    only = memory.weight_memory(build_layout(quant, causal=False), set(prefixes))
    assert only["mem_linear"] == weights // 4 + weights // BLOCK_SIZE * 2
    disk_t, disk_b = memory.disk_bytes(quant, prefixes), memory.disk_bytes(base, prefixes)
    assert disk_t["disk_linear"] == weights // 4 + weights // BLOCK_SIZE * 2
    assert disk_b["disk_linear"] == weights * 4


def test_evaluate_gates_defaults_flags_and_file(tmp_path):
    gates = evaluate.load_gates("embedding", None, [], [])
    assert gates == evaluate.DEFAULT_GATES["embedding"]
    cfg = tmp_path / "gates.json"
    cfg.write_text(json.dumps({"min": {"wiki_r1": 0.5}, "max": {"ppl_ratio": 2}}))
    gates = evaluate.load_gates("embedding", str(cfg), ["mean_cosine=0.9", "wiki_mrr=off"], [])
    assert gates["min"]["mean_cosine"] == 0.9 and gates["min"]["wiki_r1"] == 0.5
    assert "wiki_mrr" not in gates["min"] and gates["max"]["ppl_ratio"] == 2
    failures = evaluate.check_gates({"mean_cosine": 0.95, "wiki_r1": 0.4, "ppl_ratio": 3}, gates)
    assert len(failures) == 4  # wiki_r1 low, ppl_ratio high, two metrics missing
    assert any("wiki_r1" in f for f in failures) and any("lee50_spearman" in f for f in failures)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        evaluate.load_gates("embedding", None, ["mean_cosine"], [])


def test_evaluate_embedding_report_hf(bert_pair, tmp_path, capsys):
    base, quant = bert_pair
    out = tmp_path / "new-folder" / "report.json"  # a missing folder is created, not a traceback
    assert _run([str(base), str(quant), "--backend", "hf", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "Lee-50 Spearman" in table and "cosine to base, mean" in table
    report = json.loads(out.read_text())
    assert report["kind"] == "embedding" and report["agreement"]["n_texts"] == 222
    ag = report["agreement"]
    assert -1 <= ag["min_cosine"] <= ag["mean_cosine"] < 0.9999  # ternary differs from the base
    for role in ("base", "ternary"):
        m = report["models"][role]
        assert 0 <= m["wiki_r1"] <= m["wiki_r10"] <= 1 and 0 < m["wiki_mrr"] <= 1
    for key in ("disk_linear", "mem_linear"):  # fp32 vs 2 bits + fp16/128 per weight
        assert report["memory"]["ratios"][key] == pytest.approx(4 / (1 / 4 + 2 / BLOCK_SIZE))
    assert report["summary"]["mean_cosine"] == ag["mean_cosine"]
    assert report["gate"]["enabled"] is False


def test_evaluate_activations_both_compares_a8_with_a16_on_the_same_weights(bert_pair, tmp_path, capsys):
    base, quant = bert_pair
    out = tmp_path / "both.json"
    argv = [str(base), str(quant), "--backend", "hf", "--activations", "both", "--json", str(out), "--gate",
            "--min", "a8_vs_a16_mean_cosine=0.9", "--max", "a8_wiki_mrr_drop=0.5",
            "--min", "lee50_spearman=off", "--min", "wiki_mrr=off"]  # a random model retrieves nothing  # fmt: skip
    assert _run(argv) == 0
    table = capsys.readouterr().out
    assert "ternary A16" in table and "ternary A8" in table and "cosine to A16, mean" in table
    report = json.loads(out.read_text())
    assert report["activation_bits"] == {"ternary": 16, "ternary_a8": 8} and report["checkpoint_activation_bits"] == 16
    a16, a8, summary = report["models"]["ternary"], report["models"]["ternary_a8"], report["summary"]
    assert a8 != a16  # the A8 run is a run of its own
    assert 0.9 < summary["a8_vs_a16_min_cosine"] <= summary["a8_vs_a16_mean_cosine"] <= 1
    assert summary["a8_vs_a16_min_cosine"] < 1  # int8 rounding moves some embedding
    assert summary["a8_wiki_mrr_drop"] == pytest.approx(a16["wiki_mrr"] - a8["wiki_mrr"])
    assert summary["a8_wiki_mrr"] == a8["wiki_mrr"] and summary["wiki_mrr"] == a16["wiki_mrr"]
    assert summary["a8_mean_cosine"] == report["agreement"]["a8_mean_cosine"] < 1
    assert report["gate"]["passed"]


def test_evaluate_activation_runs_follow_the_checkpoint_unless_told():
    from ternop.cli.modes import activation_runs

    assert activation_runs("checkpoint", 8) == [("ternary", 8)]
    assert activation_runs("checkpoint", 16) == [("ternary", 16)]
    assert activation_runs("int8", 16) == activation_runs("int8", 8) == [("ternary", 8)]
    assert activation_runs("fp", 8) == [("ternary", 16)]
    assert activation_runs("both", 8) == [("ternary", 16), ("ternary_a8", 8)]


def test_activation_view_links_the_weights_and_patches_only_the_mode(bert_pair):
    from ternop.checkpoint import load_config, read_quant_config
    from ternop.cli.modes import activation_view

    _, quant = bert_pair
    with activation_view(quant, 16) as same:
        assert same == quant
    before = (quant / "config.json").read_text()
    with activation_view(quant, 8) as view:
        assert view != quant and read_quant_config(view)["activation_bits"] == 8
        assert (view / "model.safetensors").resolve() == (quant / "model.safetensors").resolve()
        want = load_config(quant)
        want["quantization_config"]["activation_bits"] = 8
        assert load_config(view) == want
    assert not view.exists() and (quant / "config.json").read_text() == before


def test_evaluate_refuses_unknown_activation_bits_naming_the_field(bert_pair, tmp_path, capsys):
    import shutil

    base, quant = bert_pair
    bad = tmp_path / "bad"
    shutil.copytree(quant, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["activation_bits"] = 6
    (bad / "config.json").write_text(json.dumps(config))
    assert _run([str(base), str(bad), "--backend", "hf"]) == 2
    assert "quantization_config: activation_bits 6 is not supported" in capsys.readouterr().err


def test_evaluate_rejects_a_plain_model_as_quant(bert_pair, capsys):
    base, _ = bert_pair
    assert _run([str(base), str(base), "--backend", "hf"]) == 2
    assert "not a ternary checkpoint" in capsys.readouterr().err


def test_evaluate_without_eval_data_fails_fast_with_the_fix(bert_pair, capsys, monkeypatch):
    import sys

    base, quant = bert_pair
    monkeypatch.setitem(sys.modules, "gensim", None)  # as if gensim were not installed
    monkeypatch.setitem(sys.modules, "gensim.test.utils", None)
    assert _run([str(base), str(quant), "--backend", "hf"]) == 2
    err = capsys.readouterr().err
    assert "gensim" in err and "pip install gensim==4.4.0" in err and "Traceback" not in err


def test_evaluate_causal_report(causal_pair, tmp_path):
    base, quant = causal_pair
    out = tmp_path / "causal.json"
    assert _run([str(base), str(quant), "--json", str(out), "--max-tokens", "600"]) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "causal" and report["backend"] == "hf"
    b, t = report["models"]["base"], report["models"]["ternary"]
    assert b["tokens"] == t["tokens"] > 0
    vocab = len((base / "vocab.txt").read_text().split("\n")) - 1
    # A random model is near uniform: perplexity about the vocabulary size.
    assert vocab / 3 < b["perplexity"] < vocab * 3
    assert 0 <= report["agreement"]["top1_agreement"] <= 1
    assert report["agreement"]["ppl_ratio"] == pytest.approx(t["perplexity"] / b["perplexity"])


def test_evaluate_causal_activations_both(causal_pair, tmp_path, capsys):
    base, quant = causal_pair
    out = tmp_path / "causal.json"
    assert _run([str(base), str(quant), "--json", str(out), "--max-tokens", "300", "--activations", "both"]) == 0
    assert "same top token as A16" in capsys.readouterr().out
    report = json.loads(out.read_text())
    a16, a8 = report["models"]["ternary"], report["models"]["ternary_a8"]
    assert a16["tokens"] == a8["tokens"] and a16["perplexity"] != a8["perplexity"]
    ag = report["agreement"]
    assert ag["a8_ppl_ratio"] == pytest.approx(a8["perplexity"] / report["models"]["base"]["perplexity"])
    assert 0 <= ag["a8_vs_a16_top1_agreement"] <= 1 and report["summary"]["a8_perplexity"] == a8["perplexity"]


def test_evaluate_gate_exit_code(causal_pair, capsys):
    """The gate reads the reported numbers: a bound just past the measured value fails, just inside passes."""
    base, quant = causal_pair
    common = [str(base), str(quant), "--max-tokens", "300", "--gate"]
    assert _run(common + ["--max", "ppl_ratio=1e-3"]) == 1
    out = capsys.readouterr().out
    assert "gate: FAIL" in out and "ppl_ratio" in out
    assert _run(common + ["--max", "ppl_ratio=1e6", "--min", "top1_agreement=0"]) == 0
    assert "gate: PASS" in capsys.readouterr().out


@pytest.mark.vllm
@pytest.mark.slow
def test_evaluate_vllm_embeddings_match_hf(tmp_path):
    """The vLLM path (plugin, token-id prompts, subprocess) gives the HF path's embeddings."""
    base = tiny_qwen3(tmp_path / "base")
    quant = tmp_path / "ternary"
    quantize_checkpoint(base, quant, method="absmean", progress=False)
    texts = ["Ternary weights take two bits each.", "short", "the quick brown fox jumps over the lazy dog " * 30]
    got, counted = evaluate.embed_vllm(quant, texts, "float32", True, tmp_path / "vllm.log")
    want, _ = evaluate.embed_hf_model(quant, texts, torch.float32)
    assert got.shape == want.shape == (3, 256)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    layout = memory.weight_memory(build_layout(quant, causal=False))
    if counted:  # counted inside vLLM: the same packed bytes as ternop's own layout
        assert counted["vllm_mem_linear"] == layout["mem_linear"]


def test_evaluate_missing_folders_and_json_folder_are_messages(bert_pair, tmp_path, capsys):
    base, quant = bert_pair
    assert _run([str(tmp_path / "nope"), str(quant), "--backend", "hf"]) == 2
    err = capsys.readouterr().err
    assert "model folder" in err and "does not exist" in err and "Traceback" not in err
    assert _run([str(base), str(tmp_path / "nope"), "--backend", "hf"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert _run([str(base), str(quant), "--backend", "hf", "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err

"""ternop distill --keep-dense auto: rank layers around an earlier ternary run, keep the best dense, distil the rest."""

from __future__ import annotations

import pytest
import torch

from ternop.cli import main
from tests.cli.mixed_measure import QKV0, dense_layers, fake_measure_fn


@pytest.fixture(scope="module")
def tiny_fp(tmp_path_factory):
    from tests.models import tiny_bert_wide

    return tiny_bert_wide(tmp_path_factory.mktemp("keep_dense") / "fp", seed=7)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from tests.models import word_salad

    path = tmp_path_factory.mktemp("keep_dense_data") / "train.txt"
    path.write_text("\n".join(word_salad(24, 8, seed=1)) + "\n")
    return path


def _argv(base, dst, data, *extra) -> list[str]:
    return ["distill", str(base), str(dst), "--data", str(data), "--batch-size", "4", "--quiet", "--init", "optimal",
            "--lr", "2e-3", "--lr-scale", "1e-3", "--steps", "2", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def all_ternary(tiny_fp, data_file, tmp_path_factory):
    """An earlier all-ternary run: the checkpoint the layers are ranked around."""
    dst = tmp_path_factory.mktemp("keep_dense_first") / "first"
    assert main(_argv(tiny_fp, dst, data_file)) == 0
    return dst


def test_choose_around_ranks_in_the_checkpoint_trained_model(tiny_fp, all_ternary, monkeypatch):
    """The dense model carries the checkpoint's trained norms and biases; each layer's ternary form is its codes."""
    from ternop.checkpoint import iter_tensors, load_ternary_layers
    from ternop.cli import mixed
    from ternop.format import dequantize

    ckpt = dict(iter_tensors(all_ternary))
    layers = load_ternary_layers(all_ternary)
    norm = "encoder.layer.0.attention.output.LayerNorm.weight"
    assert not torch.equal(ckpt[norm], dict(iter_tensors(tiny_fp))[norm])  # the first run trained it
    seen = []

    def fn(tokenizer, pooling, max_len):
        def measure(model):
            seen.append((model.get_submodule(norm[: -len(".weight")]).weight.detach().clone(),
                         model.get_submodule("encoder.layer.1.output.dense").weight.detach().clone()))  # fmt: skip
            return {"wiki_mrr": 0.5, "mean_cosine": 0.5}

        return measure

    monkeypatch.setattr(mixed, "_measure_fn", fn)
    choice, shapes = mixed.choose_around(str(tiny_fp), str(all_ternary), (), 0.0, progress=False, size_budget=0.3)
    assert len(shapes) == 12 and shapes["encoder.layer.1.output.dense"] == (256, 512)
    assert choice.met and choice.dense == []  # nothing to gain: the all-ternary model measures as the dense one
    (norm_dense, w_dense), (norm_tern, w_tern) = seen
    assert torch.equal(norm_dense, ckpt[norm]) and torch.equal(norm_tern, ckpt[norm])
    assert torch.equal(w_tern, dequantize(*layers["encoder.layer.1.output.dense"]).float())
    assert torch.equal(w_dense, dict(iter_tensors(tiny_fp))["encoder.layer.1.output.dense.weight"])


def test_keep_dense_auto_trains_around_what_fits_the_budget(tiny_fp, all_ternary, data_file, tmp_path, capsys,
                                                            monkeypatch):  # fmt: skip
    from ternop.checkpoint import iter_tensors, load_ternary_layers
    from ternop.cli import mixed

    monkeypatch.setattr(mixed, "_measure_fn", fake_measure_fn)
    rank = ["--keep-dense", "auto", "--rank-from", str(all_ternary)]
    # A 256x256 layer adds 113,664 bytes dense, a 512x256 one 227,328; all ternary is 278,528 of 2,097,152 in fp16.
    # output.dense is the best per byte; layer 0's query goes with its key and value (vLLM fuses them), 340,992
    # bytes, which overrun 0.3; of the layers that gain nothing the first in the checkpoint's order fits, and fills
    # the budget (the gains before training are an order, the budget the bound).
    tight = tmp_path / "tight"
    assert main(_argv(tiny_fp, tight, data_file, *rank, "--size-budget", "0.3")) == 0
    out = capsys.readouterr().out
    chosen = ["encoder.layer.1.output.dense", "encoder.layer.0.attention.output.dense"]
    assert dense_layers(tight) == sorted(chosen)
    assert "keep-dense auto: 2 of 12 layers dense, 0.295 of their fp16 bytes" in out
    assert "dense 0.9000, all ternary 0.6990, chosen 0.7990 (max loss 0.0: not met within the size budget 0.3)" in out
    assert "--skip encoder.layer.1.output.dense --skip encoder.layer.0.attention.output.dense" in out
    assert sorted(load_ternary_layers(tight)) == sorted(set(load_ternary_layers(all_ternary)) - set(chosen))
    roomy = tmp_path / "roomy"
    assert main(_argv(tiny_fp, roomy, data_file, *rank, "--size-budget", "0.45", "--max-mrr-loss", "0.01")) == 0
    assert sorted(dense_layers(roomy)) == [*QKV0, "encoder.layer.1.output.dense"]
    assert "chosen 0.8990 (max loss 0.01: met)" in capsys.readouterr().out
    # The dense layers trained with the rest (they start from the base model's weights).
    base, trained = dict(iter_tensors(tiny_fp)), dict(iter_tensors(roomy))
    key = "encoder.layer.1.output.dense.weight"
    assert trained[key].shape == base[key].shape and not torch.equal(trained[key], base[key])


def test_keep_dense_auto_resumes_with_the_layers_it_chose(tiny_fp, all_ternary, data_file, tmp_path, capsys,
                                                          monkeypatch):  # fmt: skip
    from ternop.checkpoint import iter_tensors
    from ternop.cli import mixed

    monkeypatch.setattr(mixed, "_measure_fn", fake_measure_fn)
    rank = ["--keep-dense", "auto", "--rank-from", str(all_ternary), "--size-budget", "0.19"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(_argv(tiny_fp, whole, data_file, *rank, "--steps", "3")) == 0
    assert main(_argv(tiny_fp, parts, data_file, *rank, "--steps", "3", "--stop-at", "1")) == 0
    capsys.readouterr()

    def no_measure(*args):
        raise AssertionError("a resumed run must not rank again")

    monkeypatch.setattr(mixed, "_measure_fn", no_measure)
    # Another --skip than the state's is refused, with or without --keep-dense auto.
    assert main(_argv(tiny_fp, parts, data_file, "--steps", "3", "--resume")) == 2
    assert "trained with the dense layers (--skip)" in capsys.readouterr().err
    assert main(_argv(tiny_fp, parts, data_file, *rank, "--steps", "3", "--resume")) == 0
    assert "resuming with the 1 dense layers the run chose" in capsys.readouterr().err
    a, b = dict(iter_tensors(whole)), dict(iter_tensors(parts))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("extra, message", [
    (["--keep-dense", "auto", "--size-budget", "0.25"], "--keep-dense auto needs --rank-from CKPT"),
    (["--size-budget", "0.25"], "--size-budget applies to --keep-dense auto"),
    (["--rank-from", "x", "--max-mrr-loss", "0.1"], "--rank-from, --max-mrr-loss apply to --keep-dense auto"),
    (["--keep-dense", "auto", "--rank-from", "R", "--size-budget", "0.1"], "below the all-ternary size, 0.133"),
    (["--keep-dense", "auto", "--rank-from", "R", "--size-budget", "1.5"], "must be a share in (0, 1], got 1.5"),
    (["--keep-dense", "auto", "--rank-from", "R", "--size-budget", "0.25", "--max-mrr-loss", "-1"],
     "--max-mrr-loss must be >= 0"),
    (["--keep-dense", "auto", "--rank-from", "R", "--size-budget", "0.25", "--init-from", "R"],
     "--init-from would need"),
])  # fmt: skip
def test_keep_dense_options_are_checked_before_any_model(tiny_fp, all_ternary, data_file, tmp_path, capsys,
                                                         extra, message):  # fmt: skip
    extra = [str(all_ternary) if e == "R" else e for e in extra]
    assert main(_argv(tiny_fp, tmp_path / "dst", data_file, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_keep_dense_auto_refuses_a_checkpoint_of_other_layers(tiny_fp, all_ternary, data_file, tmp_path, capsys):
    rank = ["--keep-dense", "auto", "--size-budget", "0.25"]
    assert main(_argv(tiny_fp, tmp_path / "a", data_file, *rank, "--rank-from", str(tiny_fp))) == 2
    assert "--rank-from" in (err := capsys.readouterr().err) and "not a ternary checkpoint" in err
    skip = ["--skip", "layer.0.attention.self.query"]
    assert main(_argv(tiny_fp, tmp_path / "b", data_file, *rank, *skip, "--rank-from", str(all_ternary))) == 2
    assert "not the ones this run trains" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

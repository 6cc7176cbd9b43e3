"""ternop quantize --keep-dense auto: the measured gate picks the layers kept dense."""

from __future__ import annotations

import pytest

from ternop.cli import main
from tests.cli.mixed_measure import QKV0, dense_layers, fake_measure_fn


@pytest.fixture(scope="module")
def tiny_fp(tmp_path_factory):
    from tests.models import tiny_bert_wide

    return tiny_bert_wide(tmp_path_factory.mktemp("mixed") / "fp", seed=5)


def test_keep_dense_auto_keeps_the_fewest_sensitive_layers(tiny_fp, tmp_path, capsys, monkeypatch):
    from ternop.cli import mixed

    monkeypatch.setattr(mixed, "_measure_fn", fake_measure_fn)
    both = tmp_path / "both"
    assert main(["quantize", str(tiny_fp), str(both), "--keep-dense", "auto", "--max-mrr-loss", "0.05", "--quiet"]) == 0
    out = capsys.readouterr().out
    # The query is kept with the key and value it is fused with in vLLM: all three dense, or none.
    assert sorted(dense_layers(both)) == [*QKV0, "encoder.layer.1.output.dense"]
    # Three 256x256 layers and a 256x512 one, as stored (fp32) and in fp16.
    assert "keep-dense auto: 4 layers dense (1.31 MB as stored, 0.66 MB in fp16)" in out and ": met" in out
    one = tmp_path / "one"
    assert main(["quantize", str(tiny_fp), str(one), "--keep-dense", "auto", "--max-mrr-loss", "0.15", "--quiet"]) == 0
    assert sorted(dense_layers(one)) in (QKV0, ["encoder.layer.1.output.dense"])
    loose = tmp_path / "loose"
    assert main(["quantize", str(tiny_fp), str(loose), "--keep-dense", "auto", "--max-mrr-loss", "1", "--quiet"]) == 0
    assert "keep-dense auto: 0 layers dense (0.00 MB as stored" in capsys.readouterr().out
    assert dense_layers(loose) == []


def test_size_budget_keeps_what_fits_best_per_byte(tiny_fp, tmp_path, capsys, monkeypatch):
    from ternop.cli import mixed

    monkeypatch.setattr(mixed, "_measure_fn", fake_measure_fn)
    # 1,048,576 weights: all ternary is 278,528 bytes of 2,097,152 in fp16 (0.133). Layer 0's
    # query, key and value (3 x 65,536 weights) add 340,992 bytes dense, output.dense (131,072) 227,328:
    # the better gain per byte, so a budget that holds one takes output.dense.
    from ternop.format import packed_bytes

    assert packed_bytes(256, 256) == 17408
    tight = tmp_path / "tight"
    assert main(["quantize", str(tiny_fp), str(tight), "--keep-dense", "auto", "--max-mrr-loss", "0.05",
                 "--size-budget", "0.3", "--quiet"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert dense_layers(tight) == ["encoder.layer.1.output.dense"]
    assert "NOT met within the size budget 0.3" in out
    roomy = tmp_path / "roomy"
    assert main(["quantize", str(tiny_fp), str(roomy), "--keep-dense", "auto", "--max-mrr-loss", "0.05",
                 "--size-budget", "0.45", "--quiet"]) == 0  # fmt: skip
    assert sorted(dense_layers(roomy)) == [*QKV0, "encoder.layer.1.output.dense"]
    assert ": met" in capsys.readouterr().out


def test_size_budget_is_checked(tiny_fp, tmp_path, capsys):
    args = ["quantize", str(tiny_fp), str(tmp_path / "d"), "--quiet"]
    assert main(args + ["--size-budget", "0.25"]) == 2
    assert "--size-budget applies to --keep-dense auto" in capsys.readouterr().err
    assert main(args + ["--keep-dense", "auto", "--size-budget", "1.5"]) == 2
    assert "must be a share in (0, 1], got 1.5" in capsys.readouterr().err
    assert main(args + ["--keep-dense", "auto", "--size-budget", "0.1"]) == 2
    assert "below the all-ternary size, 0.133 of fp16" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_keep_dense_auto_measures_the_real_retrieval_task(tiny_fp, tmp_path, capsys):
    # The real measurement runs end to end on a tiny model; with no loss allowed the result meets the bound.
    dst = tmp_path / "real"
    assert main(["quantize", str(tiny_fp), str(dst), "--keep-dense", "auto", "--max-mrr-loss", "0", "--quiet"]) == 0
    assert ": met" in capsys.readouterr().out


def test_keep_dense_auto_checks_before_measuring(tiny_fp, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    assert main(["quantize", str(tiny_fp), str(dst), "--keep-dense", "auto", "--quiet"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["quantize", str(tiny_fp), str(tmp_path / "n"), "--keep-dense", "auto", "--max-mrr-loss", "-1"]) == 2
    assert "max_loss must be >= 0" in capsys.readouterr().err

"""Calibrated ternarization: lower output error than rounding, exact scale refit, checkpoints via ternop quantize."""

from __future__ import annotations

import pytest
import torch

from ternop.quant import calibrate
from ternop.format import BLOCK_SIZE, dequantize, validate
from ternop.quantize import quantize_to_values


def _anisotropic_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations with a few loud channels and correlated ones, like a transformer's."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(tokens, k, generator=g) @ mix
    loud = torch.randperm(k, generator=g)[: k // 16]
    x[:, loud] *= 8.0
    return x


def _output_error(x: torch.Tensor, w: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> float:
    q = values.float() * scale.float().repeat_interleave(BLOCK_SIZE, dim=1)
    return float(((x @ (q - w).T) ** 2).sum() / ((x @ w.T) ** 2).sum())


@pytest.mark.parametrize("n,k", [(37, 256), (64, 384)])
def test_ternarize_layer_beats_optimal_rounding(n, k):
    x = _anisotropic_inputs(2048, k)
    w = torch.randn(n, k) * 0.05
    values, scale, info = calibrate.ternarize_layer(w, x.T @ x)
    assert values.dtype == torch.int8 and tuple(values.shape) == (n, k)
    assert set(values.unique().tolist()) <= {-1, 0, 1}
    assert scale.dtype == torch.float16 and tuple(scale.shape) == (n, k // BLOCK_SIZE)
    assert bool((scale >= 0).all())
    v0, s0 = quantize_to_values(w, "optimal")
    base, ours = _output_error(x, w, v0, s0), _output_error(x, w, values, scale)
    # Error feedback + scale refit cut the output error well below rounding's.
    assert ours < 0.8 * base, (ours, base)
    assert info["loss"] <= info["loss_optimal"]


def test_ternarize_layer_follows_the_fp_target():
    """With cross = X_fp^T X_q the layer compensates a perturbed input: closer to the fp output."""
    k, n = 256, 48
    xf = _anisotropic_inputs(2048, k, seed=1)
    xq = xf + 0.3 * torch.randn_like(xf)  # the input after earlier layers went ternary
    w = torch.randn(n, k) * 0.05
    h = xq.T @ xq
    plain_v, plain_s, _ = calibrate.ternarize_layer(w, h)
    fp_v, fp_s, _ = calibrate.ternarize_layer(w, h, xf.T @ xq)

    def err(v, s):
        q = v.float() * s.float().repeat_interleave(BLOCK_SIZE, dim=1)
        return float(((xq @ q.T - xf @ w.T) ** 2).sum())

    assert err(fp_v, fp_s) < err(plain_v, plain_s)


def test_refit_scales_is_least_squares():
    k, n = 384, 5
    x = _anisotropic_inputs(1024, k, seed=2)
    h = x.T @ x
    w = torch.randn(n, k)
    values, _ = quantize_to_values(w, "optimal")
    scale = calibrate._refit_scales(w, values, h, ridge=0.0)
    # Per row, the same problem solved directly: min_s || X (sum_b s_b T_b - w)^T ||^2.
    for row in range(n):
        t = values[row].float()
        basis = torch.stack([t * (torch.arange(k) // BLOCK_SIZE == b) for b in range(k // BLOCK_SIZE)], 1)
        sol = torch.linalg.lstsq((x @ basis).double(), (x @ w[row]).double()).solution.float()
        torch.testing.assert_close(scale[row], sol, rtol=2e-3, atol=1e-5)


def test_ternarize_layer_rejects_bad_h():
    with pytest.raises(ValueError, match=r"h must be \[K, K\]"):
        calibrate.ternarize_layer(torch.randn(4, 128), torch.eye(256))


@pytest.fixture(scope="module")
def tiny_fp(tmp_path_factory):
    """A tiny random BERT whose encoder weights are large enough for ternary error to show."""
    from tests.models import tiny_bert_wide

    return tiny_bert_wide(tmp_path_factory.mktemp("cal") / "fp", seed=1)


def _texts():
    from tests.models import word_salad

    return word_salad(48, 12, seed=0)


def test_calibrate_model_closer_to_fp_than_rounding(tiny_fp):
    from ternop.hf import embed_model, load_model, load_tokenizer
    from ternop.modules import quantize_module

    texts = _texts()
    fp, tok = load_model(tiny_fp), load_tokenizer(tiny_fp)
    ref = embed_model(fp, tok, texts, "mean")
    rounded = load_model(tiny_fp)
    quantize_module(rounded, method="optimal")
    cal = load_model(tiny_fp)
    results = calibrate.calibrate_model(cal, tok, texts[:32], max_tokens=2048, progress=False)
    assert len(results) == 12  # 2 layers x (q, k, v, attn out, intermediate, out)
    for name, (values, scale) in results.items():
        torch.testing.assert_close(cal.get_submodule(name).weight, calibrate._dequant(values, scale.float()))
    # Held-out texts (the last 16) too.
    cos_round = (embed_model(rounded, tok, texts, "mean") * ref).sum(-1)
    cos_cal = (embed_model(cal, tok, texts, "mean") * ref).sum(-1)
    assert float(cos_cal[32:].mean()) > float(cos_round[32:].mean())
    assert float((1 - cos_cal).mean()) < 0.7 * float((1 - cos_round).mean())


def test_quantize_cli_calibrated_writes_v1(tiny_fp, tmp_path, capsys):
    from ternop.checkpoint import load_ternary_layers, read_quant_config
    from ternop.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(_texts()) + "\n")
    dst = tmp_path / "cal"
    assert main(["quantize", str(tiny_fp), str(dst), "--method", "calibrated", "--calib", str(calib), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "calibrate" not in err and "record" not in err  # --quiet silences the calibration's bars too
    assert read_quant_config(dst)["quant_method"] == "ternary"
    layers = load_ternary_layers(dst)
    assert len(layers) == 12
    for name, (packed, scale) in layers.items():
        validate(packed, scale, name)
    # Differs from plain rounding: the calibration changed codes or scales.
    from safetensors.torch import load_file

    fp = load_file(str(tiny_fp / "model.safetensors"))
    w = fp["encoder.layer.1.output.dense.weight"]
    packed, scale = layers["encoder.layer.1.output.dense"]
    v0, s0 = quantize_to_values(w, "optimal")
    assert not torch.equal(dequantize(packed, scale), v0.float() * s0.float().repeat_interleave(BLOCK_SIZE, 1))


def test_quantize_calibrated_needs_calib(tiny_fp, tmp_path, capsys, monkeypatch):
    import ternop.hf
    from ternop.cli import main

    assert main(["quantize", str(tiny_fp), str(tmp_path / "x"), "--method", "calibrated", "--quiet"]) == 2
    assert "--calib FILE" in capsys.readouterr().err
    # A missing --calib file is reported before the model is loaded, not after.
    monkeypatch.setattr(ternop.hf, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["quantize", str(tiny_fp), str(tmp_path / "x"), "--method", "calibrated", "--calib", "nope.txt", "--quiet"]
    assert main(argv) == 2
    assert "calibration file 'nope.txt' does not exist" in capsys.readouterr().err


def test_quantize_calib_tokens_sets_how_much_text_calibration_reads(tiny_fp, tmp_path, capsys, monkeypatch):
    import ternop.hf
    from ternop.checkpoint import load_ternary_layers
    from ternop.cli import main

    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(_texts()) + "\n")
    seen = []
    real = calibrate.calibrate_model

    def spy(*args, **kwargs):
        seen.append(kwargs["max_tokens"])
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate, "calibrate_model", spy)
    base = ["quantize", str(tiny_fp), "--method", "calibrated", "--calib", str(calib), "--quiet"]
    assert main([*base, str(tmp_path / "few"), "--calib-tokens", "16"]) == 0
    assert main([*base, str(tmp_path / "default")]) == 0
    assert seen == [16, calibrate.CALIB_TOKENS]
    few, full = load_ternary_layers(tmp_path / "few"), load_ternary_layers(tmp_path / "default")
    assert any(not torch.equal(few[n][0], full[n][0]) for n in full)  # 16 tokens calibrate differently
    # A bad count is refused before the model loads.
    monkeypatch.setattr(ternop.hf, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main([*base, str(tmp_path / "bad"), "--calib-tokens", "0"]) == 2
    assert "--calib-tokens must be a positive number of tokens, got 0" in capsys.readouterr().err
    optimal = ["quantize", str(tiny_fp), str(tmp_path / "opt"), "--calib-tokens", "64", "--quiet"]
    assert main(optimal) == 2
    assert "--calib-tokens applies to --method calibrated" in capsys.readouterr().err


def test_groups_split_layers_whose_inputs_only_share_an_address():
    """q/k/v read one tensor and share a Hessian; two layers that read the same buffer before and
    after it changed in place (or a freed input's address handed out again, as the CUDA caching
    allocator does at once) must not: the second would get the first's Hessian, of the wrong size
    where their widths differ."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)
            self.later = torch.nn.Linear(128, 128)

        def forward(self, input_ids):
            buf = input_ids.clone()
            y = self.q(buf) + self.k(buf)  # one input, one group
            buf.mul_(2).add_(y)  # the same storage, new values
            return self.later(buf)

    model = Model()
    linears = {"q": model.q, "k": model.k, "later": model.later}
    groups = calibrate._groups(model, linears, {"input_ids": torch.randn(4, 128)})
    assert groups == [["q", "k"], ["later"]]


def test_one_pass_captures_what_each_layer_reads(tiny_fp):
    """The fp inputs of every group come from one pass of the model a batch; they must be the
    tensors that stopping the model at each layer in turn captures, as fp16 copies."""
    from ternop.hf import load_model, load_tokenizer
    from ternop.selection import select_linears

    model, tok = load_model(tiny_fp), load_tokenizer(tiny_fp)
    batches = calibrate._batches(tok, _texts()[:20], 32, 512, 8)
    linears, _ = select_linears(model, ())
    groups = calibrate._groups(model, linears, batches[0])
    firsts = {group[0]: linears[group[0]] for group in groups}
    passes = []
    handle = model.register_forward_pre_hook(lambda mod, args: passes.append(1))
    try:
        captured = calibrate._capture_first_calls(model, firsts, batches)
    finally:
        handle.remove()
    assert len(passes) == len(batches) > 1
    assert list(captured) == list(firsts) and len(firsts) == 8  # 2 layers x (qkv, attn out, intermediate, out)
    for name, module in firsts.items():
        alone = calibrate._capture(model, module, batches)
        assert len(captured[name]) == len(alone)
        for got, want in zip(captured[name], alone):
            assert got.dtype == torch.float16
            torch.testing.assert_close(got, want.half(), rtol=0, atol=0)


def test_one_pass_capture_copies_inputs_changed_in_place_later():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)

        def forward(self, input_ids, attention_mask):
            buf = input_ids.clone()
            y = self.first(buf)
            buf.mul_(2)  # what first read, changed after it read it
            return self.second(buf + y) + self.first(buf)  # first again: only its first call counts

    model = Model()
    x = torch.randn(2, 3, 128)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = calibrate._capture_first_calls(model, {"first": model.first, "second": model.second},
                                         [{"input_ids": x, "attention_mask": mask}])  # fmt: skip
    assert len(got["first"]) == 1 and len(got["second"]) == 1
    torch.testing.assert_close(got["first"][0], x[mask.bool()].half(), rtol=0, atol=0)


def test_calibration_shows_its_recording_passes_and_its_layers(tiny_fp, capsys):
    """The passes that record the fp inputs and the blocks' calls come before the first layer is
    done; on a large model they take minutes, so they have a bar of their own."""
    from ternop.hf import load_model, load_tokenizer

    model, tok = load_model(tiny_fp), load_tokenizer(tiny_fp)
    calibrate.calibrate_model(model, tok, _texts()[:16], max_tokens=256, batch_size=8)
    err = capsys.readouterr().err
    batches = len(calibrate._batches(tok, _texts()[:16], 128, 256, 8))
    assert "record: 100%" in err and f"{2 * batches}/{2 * batches}" in err
    assert "calibrate: 100%" in err and "12/12" in err

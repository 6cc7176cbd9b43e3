"""ternop distill: the straight-through layer, training that lowers the loss, resume, and the v1 output."""

from __future__ import annotations

import argparse

import pytest
import torch

from ternop.cli import distill as distill_cli
from ternop.quant import distill
from ternop.format import BLOCK_SIZE, dequantize, validate


def test_qat_linear_forward_is_ternary_and_grads_flow():
    torch.manual_seed(0)
    latent = torch.randn(13, 256) * 0.05
    scale = torch.full((13, 2), 0.04)
    layer = distill.QATLinear(latent, scale, torch.randn(13))
    x = torch.randn(5, 256, requires_grad=True)
    y = layer(x)
    values = layer.values()
    assert set(values.unique().tolist()) <= {-1, 0, 1}
    dense = values.float() * scale.repeat_interleave(BLOCK_SIZE, dim=1)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, dense, layer.bias))
    y.square().sum().backward()
    for name in ("weight", "scale", "bias"):
        grad = getattr(layer, name).grad
        assert grad is not None and bool(grad.abs().sum() > 0), name
    assert x.grad is not None


def test_int8_activations_round_as_w2a8_and_pass_gradients_straight_through():
    from ternop.activations import quantize_rows

    x = (torch.randn(3, 7, 256) * torch.logspace(-2, 1, 256)).requires_grad_(True)
    xq = distill.int8_activations(x)
    q, sx = quantize_rows(x.detach().reshape(-1, 256))
    assert torch.equal(xq.detach().reshape(-1, 256), q.float() * sx[:, None])  # exactly the spec's values
    assert not torch.equal(xq.detach(), x.detach())
    g = torch.randn_like(x)
    (xq * g).sum().backward()
    assert torch.equal(x.grad, g)


def _exact_layer(n: int, k: int, bits: int, seed: int = 1):
    """A QATLinear whose latent weight is already ternary x fp16-exact scales, and its v1 (packed, scale)."""
    from ternop.format import pack_codes, values_to_codes

    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (n, k), generator=g)
    scale = (torch.rand(n, k // BLOCK_SIZE, generator=g) * 0.1 + 0.01).half().float()
    latent = values.float() * scale.repeat_interleave(BLOCK_SIZE, dim=1)
    layer = distill.QATLinear(latent, scale, torch.randn(n, generator=g), activation_bits=bits)
    assert torch.equal(layer.values(), values.to(torch.int8))
    return layer, pack_codes(values_to_codes(values)), scale.half()


def test_qat_linear_a8_forward_is_the_w2a8_op_and_grads_flow():
    import ternop

    layer, packed, scale = _exact_layer(37, 384, 8)
    x = (torch.randn(2, 5, 384) * 3).requires_grad_(True)
    y = layer(x)
    want = ternop.linear(x.detach(), packed, scale, layer.bias.detach(), activation_bits=8)
    torch.testing.assert_close(y.detach(), want, rtol=1e-5, atol=1e-5)
    a16 = ternop.linear(x.detach(), packed, scale, layer.bias.detach())
    assert float((y.detach() - a16).abs().max()) > 1e-3  # the int8 rounding is in the forward pass
    y.square().sum().backward()
    for name in ("weight", "scale", "bias"):
        grad = getattr(layer, name).grad
        assert grad is not None and bool(grad.abs().sum() > 0), name
    # Straight-through: x's gradient is that of the dense product, as if x were not rounded.
    xs = x.detach().requires_grad_(True)
    dense = layer.values().float() * layer.scale.detach().repeat_interleave(BLOCK_SIZE, dim=1)
    torch.nn.functional.linear(xs, dense).backward(2 * y.detach())
    torch.testing.assert_close(x.grad, xs.grad)


def test_qat_linear_rejects_unknown_activation_bits():
    with pytest.raises(ValueError, match="activation_bits 4"):
        distill.QATLinear(torch.zeros(4, 128), torch.ones(4, 1), None, activation_bits=4)


def test_qat_linear_rejects_bad_scale_shape():
    with pytest.raises(ValueError, match=r"scale \[N, K/128\]"):
        distill.QATLinear(torch.zeros(4, 256), torch.ones(4, 3), None)


def test_qat_linear_row_scale_forward_and_grads():
    torch.manual_seed(0)
    latent = torch.randn(13, 256) * 0.05
    scale = torch.rand(13, 1) * 0.05 + 0.02
    layer = distill.QATLinear(latent, scale, None)
    x = torch.randn(5, 256)
    dense = layer.values().float() * scale  # one scale over each row
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, dense))
    layer(x).square().sum().backward()
    assert layer.scale.grad.shape == (13, 1) and bool(layer.scale.grad.abs().sum() > 0)


@pytest.fixture(scope="module")
def tiny_fp(tmp_path_factory):
    from tests.models import tiny_bert_wide

    return tiny_bert_wide(tmp_path_factory.mktemp("distill") / "fp", seed=2)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from tests.models import word_salad

    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text("\n".join(word_salad(40, 10, seed=0)) + "\n")
    return path


def _args(base, dst, data, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    distill_cli.add_arguments(parser)
    argv = [str(base), str(dst), "--data", str(data), "--batch-size", "8", "--quiet", "--init", "optimal",
            "--lr", "2e-3", "--lr-scale", "1e-3"]  # fmt: skip
    for key, value in kw.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return parser.parse_args(argv)


def _cosine_to_teacher(base, ckpt, texts) -> float:
    from ternop.hf import embed_texts

    a = embed_texts(base, texts)
    b = embed_texts(ckpt, texts, dense=True)
    return float((a * b).sum(-1).mean())


def test_distill_improves_on_rounding_and_writes_v1(tiny_fp, data_file, tmp_path):
    from ternop.checkpoint import load_ternary_layers, read_quant_config
    from ternop.quant.convert import quantize_checkpoint

    texts = data_file.read_text().splitlines()
    rounded = tmp_path / "rounded"
    quantize_checkpoint(tiny_fp, rounded, method="optimal", progress=False)
    dst = tmp_path / "distilled"
    assert distill_cli.main(_args(tiny_fp, dst, data_file, steps=25)) == 0
    assert read_quant_config(dst)["quant_method"] == "ternary"
    layers = load_ternary_layers(dst)
    assert len(layers) == 12
    for name, (packed, scale) in layers.items():
        validate(packed, scale, name)
        assert bool(torch.isfinite(dequantize(packed, scale)).all())
    assert not (tmp_path / "distilled.distill-state.pt").exists()  # removed once DST is written
    before = _cosine_to_teacher(tiny_fp, rounded, texts)
    after = _cosine_to_teacher(tiny_fp, dst, texts)
    assert after > before + 0.5 * (1 - before), (before, after)


def test_distill_int8_trains_through_the_rounding_and_records_activation_bits_8(tiny_fp, data_file, tmp_path):
    from ternop.checkpoint import read_quant_config
    from ternop.hf import embed_texts, load_model
    from ternop.modules import TernaryLinear
    from ternop.quant.convert import quantize_checkpoint

    texts = data_file.read_text().splitlines()
    rounded = tmp_path / "rounded"
    quantize_checkpoint(tiny_fp, rounded, method="optimal", progress=False, activation_bits=8)
    dst = tmp_path / "distilled"
    assert distill_cli.main(_args(tiny_fp, dst, data_file, steps=25, activations="int8")) == 0
    assert read_quant_config(dst)["activation_bits"] == 8
    layers = [m for m in load_model(dst).modules() if isinstance(m, TernaryLinear)]
    assert len(layers) == 12 and all(m.activation_bits == 8 for m in layers)
    teacher = embed_texts(tiny_fp, texts)
    # Both scored in A8, through the op (TernaryLinear), as the checkpoints run.
    before = float((embed_texts(rounded, texts) * teacher).sum(-1).mean())
    after = float((embed_texts(dst, texts) * teacher).sum(-1).mean())
    assert after > before + 0.5 * (1 - before), (before, after)


def test_distill_resume_refuses_another_activation_mode(tiny_fp, data_file, tmp_path, capsys):
    from ternop.cli import main

    argv = ["distill", str(tiny_fp), str(tmp_path / "d"), "--data", str(data_file), "--steps", "2", "--quiet",
            "--init", "optimal"]  # fmt: skip
    assert main([*argv, "--stop-at", "1"]) == 0
    assert main([*argv, "--resume", "--activations", "int8"]) == 2
    assert "trained with activation_bits 16, not 8" in capsys.readouterr().err
    assert not (tmp_path / "d").exists() and (tmp_path / "d.distill-state.pt").exists()


def test_distill_row_scales_train_and_write_one_scale_per_row(tiny_fp, data_file, tmp_path, capsys):
    from ternop.checkpoint import load_ternary_layers
    from ternop.cli import main
    from ternop.quant.convert import quantize_checkpoint
    from ternop.quantize import quantize_weight

    texts = data_file.read_text().splitlines()
    rounded = tmp_path / "rounded"
    quantize_checkpoint(tiny_fp, rounded, quantizer=lambda p, w: quantize_weight(w, "optimal", scales="row"),
                        progress=False)  # fmt: skip
    dst = tmp_path / "row"
    assert distill_cli.main(_args(tiny_fp, dst, data_file, steps=25, scales="row")) == 0
    layers = load_ternary_layers(dst)
    assert len(layers) == 12 and all(bool((s == s[:, :1]).all()) for _, s in layers.values())
    before = _cosine_to_teacher(tiny_fp, rounded, texts)
    after = _cosine_to_teacher(tiny_fp, dst, texts)
    assert after > before + 0.5 * (1 - before), (before, after)
    # Calibration fits a scale per block: refused, before any training.
    argv = ["distill", str(tiny_fp), str(tmp_path / "c"), "--data", str(data_file), "--steps", "2", "--quiet",
            "--scales", "row"]  # fmt: skip
    assert main(argv) == 2 and "--scales row starts from --init optimal or absmean" in capsys.readouterr().err
    # A state trained with block scales does not resume as rows.
    argv = ["distill", str(tiny_fp), str(tmp_path / "d"), "--data", str(data_file), "--steps", "2", "--quiet",
            "--init", "optimal"]  # fmt: skip
    assert main([*argv, "--stop-at", "1"]) == 0
    assert main([*argv, "--resume", "--scales", "row"]) == 2
    assert "trained with --scales block, not row" in capsys.readouterr().err


def test_distill_resume_equals_uninterrupted(tiny_fp, data_file, tmp_path):
    from ternop.checkpoint import load_ternary_layers

    straight = tmp_path / "straight"
    assert distill_cli.main(_args(tiny_fp, straight, data_file, steps=6, save_every=3)) == 0
    resumed = tmp_path / "resumed"
    state = tmp_path / "state.pt"
    assert distill_cli.main(_args(tiny_fp, resumed, data_file, steps=6, stop_at=3, state=state)) == 0
    assert torch.load(state)["step"] == 3 and not resumed.exists()
    assert distill_cli.main(_args(tiny_fp, resumed, data_file, steps=6, state=state, resume=True)) == 0
    a, b = load_ternary_layers(straight), load_ternary_layers(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name][0], b[name][0]), name
        torch.testing.assert_close(a[name][1], b[name][1], rtol=0, atol=0)


def test_distill_rejects_bad_steps(tiny_fp, data_file, tmp_path, capsys):
    assert distill_cli.main(_args(tiny_fp, tmp_path / "x", data_file, steps=0)) == 2
    assert "--steps" in capsys.readouterr().err


def test_distill_refuses_a_nonempty_destination_before_training(tiny_fp, data_file, tmp_path, capsys):
    from ternop.cli import main

    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    argv = ["distill", str(tiny_fp), str(dst), "--data", str(data_file), "--steps", "1", "--quiet"]
    assert main(argv) == 2
    assert "exists and is not empty (use --force" in capsys.readouterr().err
    assert (dst / "notes.txt").read_text() == "mine" and not (tmp_path / "dst.distill-state.pt").exists()
    assert main([*argv, "--force", "--init", "optimal"]) == 0
    assert not (dst / "notes.txt").exists() and (dst / "config.json").exists()


def test_distill_keep_state_and_stop_message(tiny_fp, data_file, tmp_path, capsys):
    from ternop.cli import main

    argv = ["distill", str(tiny_fp), str(tmp_path / "d"), "--data", str(data_file), "--steps", "2", "--quiet",
            "--init", "optimal"]  # fmt: skip
    assert main([*argv, "--stop-at", "1"]) == 0
    assert f"state in {tmp_path / 'd'}.distill-state.pt" in capsys.readouterr().out
    assert main([*argv, "--resume", "--keep-state"]) == 0
    assert (tmp_path / "d.distill-state.pt").exists() and (tmp_path / "d" / "config.json").exists()


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory):
    from tests.models import word_salad

    path = tmp_path_factory.mktemp("mixed") / "train.txt"
    lines = word_salad(30, 2, seed=3) + word_salad(30, 10, seed=4) + word_salad(10, 40, seed=5)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_distill_v2_objectives_mix_schedule_log_and_exports(tiny_fp, mixed_data, tmp_path):
    import json

    from ternop.checkpoint import load_ternary_layers

    log = tmp_path / "log.jsonl"
    dst = tmp_path / "d"
    args = _args(tiny_fp, dst, mixed_data, steps=12, mix="1,1,1", rel_weight=1.0, hidden_layers="all",
                 schedule="cosine", warmup=3, export_every=5, log=log, log_every=4)  # fmt: skip
    assert distill_cli.main(args) == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    steps = [x["step"] for x in lines if "done" not in x]
    assert steps == [4, 8, 12]
    assert {"loss", "cos", "rel", "hmse", "lr", "lr_scale", "seconds"} <= set(lines[0])
    assert lines[-1]["done"] and lines[-1]["steps"] == 12
    # Warm-up to the peak (step 3 logs the lr of step index 3 = peak), then cosine decay.
    assert lines[1]["lr"] < 2e-3 and lines[2]["lr"] < lines[1]["lr"]
    assert lines[2]["lr_scale"] / lines[2]["lr"] == pytest.approx(args.lr_scale / args.lr)  # one schedule, two peaks
    for step in (5, 10):
        exported = load_ternary_layers(tmp_path / f"d.step{step}")
        assert len(exported) == 12
    assert not (tmp_path / "d.step12").exists() and (dst / "config.json").exists()


def test_distill_time_limit_shortens_the_schedule(tiny_fp, data_file, tmp_path, capsys):
    import json

    from ternop.quant.distill import DistillConfig, run

    texts = data_file.read_text().splitlines()
    log = tmp_path / "log.jsonl"
    # A limit already spent when training starts: the run stops after its first step and still writes DST.
    cfg = DistillConfig(steps=1000, batch_size=4, init="optimal", quiet=True, time_limit=1e-3, log=str(log), save_every=5)
    out = run(tiny_fp, tmp_path / "d", texts, cfg)
    assert out["steps"] == 1 and out["time_limited"] and (tmp_path / "d" / "config.json").exists()
    assert json.loads(log.read_text().splitlines()[-1])["steps"] == 1
    # A generous one changes nothing, also when re-estimated on the last step.
    cfg = DistillConfig(steps=4, batch_size=4, init="optimal", quiet=True, time_limit=3600, save_every=2)
    out = run(tiny_fp, tmp_path / "e", texts, cfg)
    assert out["steps"] == 4 and not out["time_limited"] and (tmp_path / "e" / "config.json").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("mix", "1,2", "--mix expects three probabilities"),
    ("mix", "a,b,c", "--mix expects three probabilities"),
    ("time_limit", "0", "--time-limit must be > 0"),
    ("log_every", "0", "--log-every must be >= 1"),
    ("warmup", "-1", "--warmup must be >= 0"),
])  # fmt: skip
def test_distill_rejects_bad_v2_options(tiny_fp, data_file, tmp_path, capsys, flag, value, message):
    from ternop.cli import main

    argv = ["distill", str(tiny_fp), str(tmp_path / "d"), "--data", str(data_file), "--quiet",
            "--" + flag.replace("_", "-"), value]  # fmt: skip
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d.distill-state.pt").exists()


def test_distill_tf32_is_the_cuda_default_and_no_tf32_turns_it_off(tiny_fp, data_file, tmp_path):
    assert distill_cli.config_from_args(_args(tiny_fp, tmp_path / "a", data_file)).tf32 is True
    args = _args(tiny_fp, tmp_path / "b", data_file, steps=2, no_tf32=True)
    assert distill_cli.config_from_args(args).tf32 is False
    before = torch.get_float32_matmul_precision()
    assert distill_cli.main(args) == 0
    assert torch.get_float32_matmul_precision() == before  # a run leaves the process as it found it


def test_distill_init_from_an_earlier_run_starts_exactly_where_it_ended(tiny_fp, data_file, tmp_path):
    from ternop.checkpoint import iter_tensors
    from ternop.cli import main

    first = tmp_path / "first"
    argv = ["distill", str(tiny_fp), "--data", str(data_file), "--batch-size", "8", "--quiet", "--init", "optimal"]
    assert main([*argv[:2], str(first), *argv[2:], "--steps", "4", "--lr", "2e-3", "--lr-scale", "1e-3"]) == 0
    # A run at learning rate 0 writes back its start: the codes, scales, biases and norms it took from `first`.
    again = tmp_path / "again"
    assert main([*argv[:2], str(again), *argv[2:], "--steps", "1", "--lr", "0", "--lr-scale", "0",
                 "--init-from", str(first)]) == 0  # fmt: skip
    a, b = dict(iter_tensors(first)), dict(iter_tensors(again))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    base = dict(iter_tensors(tiny_fp))
    trained = [k for k in base if k in a and "LayerNorm" in k and not torch.equal(base[k], a[k])]
    assert trained  # the first run moved the norms, so the check above covers loading them


def test_distill_init_from_keeps_the_scales_unless_given_a_scale_learning_rate(tiny_fp, data_file, tmp_path):
    """A run --init-from an earlier one trains codes, biases and norms but keeps that run's block scales
    (their fresh Adam moments blow small gradients up to full steps); an explicit --lr-scale trains them."""
    from ternop.checkpoint import iter_tensors
    from ternop.cli import main

    first = tmp_path / "first"
    argv = ["distill", str(tiny_fp), "--data", str(data_file), "--batch-size", "8", "--quiet", "--init", "optimal",
            "--lr", "2e-3"]  # fmt: skip
    assert main([*argv[:2], str(first), *argv[2:], "--steps", "4", "--lr-scale", "1e-3"]) == 0
    kept, trained = tmp_path / "kept", tmp_path / "trained"
    assert main([*argv[:2], str(kept), *argv[2:], "--steps", "4", "--init-from", str(first)]) == 0
    assert main([*argv[:2], str(trained), *argv[2:], "--steps", "4", "--init-from", str(first),
                 "--lr-scale", "1e-3"]) == 0  # fmt: skip
    a, k, t = (dict(iter_tensors(d)) for d in (first, kept, trained))
    scales = [n for n in a if n.endswith(".weight_scale")]
    moved = [n for n in a if "LayerNorm" in n and not torch.equal(a[n], k[n])]
    assert scales and moved  # the run without --lr-scale did train (its norms moved) ...
    assert all(torch.equal(a[n], k[n]) for n in scales)  # ... but left every block scale as it was
    assert any(not torch.equal(a[n], t[n]) for n in scales)
    from ternop.quant.student_init import LR_SCALE, scales_lr

    assert scales_lr(None, None) == LR_SCALE
    assert scales_lr(None, "ckpt") == 0.0
    assert scales_lr(5e-5, "ckpt") == 5e-5


def test_distill_init_from_refuses_what_it_cannot_continue(tiny_fp, data_file, tmp_path, capsys):
    from ternop.cli import main

    first = tmp_path / "first"
    argv = ["distill", str(tiny_fp), "--data", str(data_file), "--batch-size", "8", "--quiet", "--init", "optimal",
            "--steps", "1"]  # fmt: skip
    assert main([*argv[:2], str(first), *argv[2:]]) == 0
    assert main([*argv[:2], str(tmp_path / "a"), *argv[2:], "--init-from", str(tiny_fp)]) == 2
    assert "not a ternary checkpoint" in capsys.readouterr().err
    skip = ["--skip", "layer.0.attention.self.query"]
    assert main([*argv[:2], str(tmp_path / "b"), *argv[2:], *skip, "--init-from", str(first)]) == 2
    err = capsys.readouterr().err
    assert "not the ones this run trains" in err and "layer.0.attention.self.query" in err
    assert main([*argv[:2], str(tmp_path / "c"), *argv[2:], "--resume", "--init-from", str(first)]) == 2
    assert "--init-from starts a new run" in capsys.readouterr().err
    assert main([*argv[:2], str(first), *argv[2:], "--force", "--init-from", str(first)]) == 2
    assert "are one folder" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "abc")  # nothing half-written

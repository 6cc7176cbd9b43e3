import pytest
import torch

from ternop import dequantize, quantize_weight
from ternop.quantize import quantize_to_values


def _block_sq_error(w: torch.Tensor, packed, scale) -> torch.Tensor:
    """Per-block squared L2 error, fp64, shape [N, K/128]."""
    err = (w.double() - dequantize(packed, scale, torch.float64)) ** 2
    return err.reshape(w.shape[0], -1, 128).sum(-1)


def _matrices():
    g = torch.Generator().manual_seed(1)
    normal = torch.randn(64, 512, generator=g)
    heavy = torch.distributions.StudentT(2.0).sample((64, 512))
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((64, 512))
    outliers = torch.randn(64, 512, generator=g)
    outliers[torch.rand(64, 512, generator=g) < 0.01] *= 50
    sparse = torch.randn(64, 512, generator=g) * (torch.rand(64, 512, generator=g) < 0.1)
    return {"normal": normal, "student_t2": heavy, "laplace": laplace, "outliers": outliers, "sparse": sparse}


@pytest.mark.parametrize("kind", list(_matrices()))
def test_quantize_optimal_never_worse_than_absmean(kind):
    w = _matrices()[kind]
    e_opt = _block_sq_error(w, *quantize_weight(w, "optimal"))
    e_abs = _block_sq_error(w, *quantize_weight(w, "absmean"))
    # Both scales are rounded to fp16; allow that rounding (relative 2^-10), nothing more.
    assert bool((e_opt <= e_abs * (1 + 1e-3) + 1e-12).all())
    assert float(e_opt.sum()) <= float(e_abs.sum())


def test_quantize_optimal_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 256, generator=g) * torch.rand(3, 256, generator=g)
    values, scale = quantize_to_values(w, "optimal")
    ours = ((w.double() - values.double() * scale.double().repeat_interleave(128, 1)) ** 2).reshape(-1, 128).sum(-1)
    for b, block in enumerate(w.double().reshape(-1, 128)):
        # Every ternary code with a common scale: the best uses the top-j magnitudes for some j.
        mags = block.abs().sort(descending=True).values
        best = min(float((block**2).sum() - mags[:j].sum() ** 2 / j) for j in range(1, 129))
        assert float(ours[b]) == pytest.approx(best, rel=2e-3, abs=1e-9)


def test_quantize_absmean_formula():
    w = torch.zeros(1, 128)
    w[0, :4] = torch.tensor([1.0, -0.2, 3.0, -2.0])
    values, scale = quantize_to_values(w, "absmean")
    s = 6.2 / 128
    assert float(scale[0, 0]) == pytest.approx(s, rel=1e-3)
    assert values[0, :5].tolist() == [1, -1, 1, -1, 0]


def test_quantize_zero_block():
    w = torch.zeros(2, 256)
    w[1, 130] = 2.0
    for method in ("optimal", "absmean"):
        packed, scale = quantize_weight(w, method)
        assert scale[0].tolist() == [0.0, 0.0]
        assert float(scale[1, 0]) == 0.0
        assert torch.equal(dequantize(packed, scale)[0], torch.zeros(256))
    packed, scale = quantize_weight(w, "optimal")
    assert torch.equal(dequantize(packed, scale), w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_accepts_float_dtypes(dtype):
    w = torch.randn(8, 128).to(dtype)
    packed, scale = quantize_weight(w)
    assert packed.dtype == torch.uint8 and packed.shape == (8, 32)
    assert scale.dtype == torch.float16 and scale.shape == (8, 1)


@pytest.mark.parametrize(
    "w, method, message",
    [
        (torch.randn(4, 100), "optimal", "K=100.*multiple of 128"),
        (torch.randn(128), "optimal", "2-D"),
        (torch.randint(0, 3, (4, 128)), "optimal", "floating-point"),
        (torch.full((4, 128), float("nan")), "optimal", "NaN or Inf"),
        (torch.randn(4, 128), "rounding", "unknown quantization method 'rounding'"),
        (torch.randn(4, 128) * 1e6, "absmean", "float16 range"),
    ],
)
def test_quantize_errors(w, method, message):
    with pytest.raises(ValueError, match=message):
        quantize_weight(w, method)


@pytest.mark.parametrize("method", ["optimal", "absmean"])
def test_quantize_row_scales_fit_each_row_as_one_block(method):
    w = _matrices()["laplace"]
    values, scale = quantize_to_values(w, method, scales="row")
    assert scale.shape == (64, 4) and bool((scale == scale[:, :1]).all())
    if method == "absmean":
        assert torch.allclose(scale[:, 0].float(), w.abs().mean(dim=1), rtol=1e-3)
        assert torch.equal(values, torch.round(torch.clamp(w / w.abs().mean(dim=1, keepdim=True), -1, 1)).to(torch.int8))
    # A row scale can only fit worse than a scale per block, never better.
    row_err = ((w.double() - values.double() * scale.double().repeat_interleave(128, 1)) ** 2).sum()
    assert float(row_err) >= float(_block_sq_error(w, *quantize_weight(w, method)).sum())
    # One block per row: both granularities are the same fit.
    w128 = w[:, :128]
    assert all(torch.equal(a, b) for a, b in zip(quantize_to_values(w128, method, "row"), quantize_to_values(w128, method)))


def test_quantize_row_optimal_never_worse_than_row_absmean():
    for w in _matrices().values():
        err = {}
        for method in ("optimal", "absmean"):
            values, scale = quantize_to_values(w, method, scales="row")
            err[method] = ((w.double() - values.double() * scale.double().repeat_interleave(128, 1)) ** 2).sum(1)
        assert bool((err["optimal"] <= err["absmean"] * (1 + 1e-3) + 1e-12).all())


def test_quantize_unknown_scales():
    with pytest.raises(ValueError, match="unknown scale granularity 'tensor'"):
        quantize_weight(torch.randn(4, 128), "optimal", scales="tensor")

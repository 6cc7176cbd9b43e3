import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ternop import format as fmt
from tests.reference import dense_weight, random_packed, unpack_values


def test_format_golden_bytes():
    # Written by hand from the spec: byte = c0 | c1<<2 | c2<<4 | c3<<6, 0b01 = +1, 0b10 = -1.
    values = torch.tensor([[+1, 0, -1, +1, 0, 0, -1, -1]])
    codes = fmt.values_to_codes(values)
    assert codes.tolist() == [[1, 0, 2, 1, 0, 0, 2, 2]]
    packed = fmt.pack_codes(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x61, 0xA0]]
    assert fmt.unpack_codes(packed).tolist() == codes.tolist()


def test_format_golden_dequantize_one_block():
    # A 128-wide row whose first byte is 0x61 (+1, 0, -1, +1) and the rest zero, scale 0.5.
    packed = torch.zeros((1, 32), dtype=torch.uint8)
    packed[0, 0] = 0x61
    packed[0, 31] = 0b10_00_00_01  # k=124 is +1, k=127 is -1
    scale = torch.tensor([[0.5]], dtype=torch.float16)
    w = fmt.dequantize(packed, scale)
    expected = torch.zeros((1, 128))
    expected[0, [0, 3, 124]] = 0.5
    expected[0, [2, 127]] = -0.5
    assert torch.equal(w, expected)


def test_format_dequantize_matches_independent_reader():
    packed, scale = random_packed(37, 384, reserved=True)
    ours = fmt.dequantize(packed, scale, torch.float64).numpy()
    assert (ours == dense_weight(packed, scale)).all()


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_format_pack_roundtrip(n, k4, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 3, (n, 4 * k4), generator=g).to(torch.uint8)
    packed = fmt.pack_codes(codes)
    assert packed.shape == (n, k4)
    assert torch.equal(fmt.unpack_codes(packed), codes)
    values = fmt.codes_to_values(codes)
    assert torch.equal(fmt.values_to_codes(values), codes)
    assert (torch.from_numpy(unpack_values(packed)) == values.double()).all()


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=1, max_size=64))
def test_format_reserved_detection_matches_per_slot_check(raw):
    packed = torch.tensor(list(raw), dtype=torch.uint8).reshape(1, -1)
    expected = [any(((b >> s) & 3) == 3 for s in (0, 2, 4, 6)) for b in raw]
    assert fmt.has_reserved_codes(packed)[0].tolist() == expected


def test_format_reserved_code_rejected_by_validator():
    packed, scale = random_packed(4, 128)
    packed[2, 5] = 0b11_00_01_10
    with pytest.raises(fmt.FormatError, match=r"layers\.0\.q_proj.*reserved code 0b11.*row 2, byte 5"):
        fmt.validate(packed, scale, name="layers.0.q_proj")


def test_format_reserved_code_reads_as_zero():
    assert fmt.codes_to_values(torch.tensor([0, 1, 2, 3], dtype=torch.uint8)).tolist() == [0, 1, -1, 0]
    packed = torch.full((2, 32), 0xFF, dtype=torch.uint8)  # every code is 0b11
    scale = torch.ones((2, 1), dtype=torch.float16)
    assert torch.equal(fmt.dequantize(packed, scale), torch.zeros(2, 128))


def test_format_nonfinite_scale_rejected():
    packed, scale = random_packed(3, 256)
    scale[1, 1] = float("nan")
    with pytest.raises(fmt.FormatError, match=r"mlp\.up.*non-finite.*row 1, block 1"):
        fmt.validate(packed, scale, name="mlp.up")


@pytest.mark.parametrize(
    "packed, scale, message",
    [
        (torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.float16), "weight_packed must be uint8"),
        (torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float32), "weight_scale must be float16"),
        (torch.zeros(128, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float16), "must be 2-D"),
        (torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float16), "K=32.*multiple of the block size 128"),
        (torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float16), r"weight_scale must have shape \[N, K/128\] = \[4, 2\]"),
        (torch.zeros(0, 32, dtype=torch.uint8), torch.zeros(0, 1, dtype=torch.float16), "empty"),
    ],
)
def test_format_check_shapes_errors(packed, scale, message):
    with pytest.raises(fmt.FormatError, match=message):
        fmt.check_shapes(packed, scale)


def test_format_pack_rejects_bad_codes():
    with pytest.raises(fmt.FormatError, match="multiple of 4"):
        fmt.pack_codes(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(fmt.FormatError, match="2-bit"):
        fmt.pack_codes(torch.full((2, 4), 4, dtype=torch.uint8))
    with pytest.raises(fmt.FormatError, match="-1, 0 or \\+1"):
        fmt.values_to_codes(torch.tensor([2, 0]))


def test_format_packed_bytes():
    assert fmt.packed_bytes(4096, 14336) == 4096 * 14336 // 4 + 4096 * 112 * 2

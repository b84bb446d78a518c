"""Ternary packing: 2-bit kernel layout and base-3 storage, exact round trips (every 5-weight code), the layout's
bit positions, padding, refusals."""

import itertools

import pytest
import torch

from thrifty.bitnet.pack import (GROUP, pack_base3, pack_ternary, padded_k, unpack_base3, unpack_codes,
                                 unpack_ternary)

ALL_CODES = torch.tensor(list(itertools.product((-1, 0, 1), repeat=5)), dtype=torch.int8)  # 243 × 5


def random_ternary(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)


def test_every_five_weight_code_round_trips_in_both_formats():
    assert ALL_CODES.shape == (243, 5)
    assert torch.equal(unpack_ternary(pack_ternary(ALL_CODES), 5), ALL_CODES)
    assert torch.equal(unpack_base3(pack_base3(ALL_CODES), ALL_CODES.shape), ALL_CODES)
    # one byte per row of 5 in base 3: the 243 codes are the 243 byte values 0..242, each once
    one_per_byte = pack_base3(ALL_CODES)
    assert sorted(one_per_byte.tolist()) == list(range(243))


@pytest.mark.parametrize("n,k", [(1, 1), (3, 3), (2, 5), (7, 6), (5, 255), (4, 257), (3, 513), (1, 1021)])
def test_round_trip_at_sizes_not_a_multiple_of_4_or_5(n, k):
    w = random_ternary(n, k, seed=n * 1000 + k)
    packed = pack_ternary(w)
    assert packed.dtype == torch.uint8 and packed.shape == (n, padded_k(k) // 4)
    assert torch.equal(unpack_ternary(packed, k), w)
    b3 = pack_base3(w)
    assert b3.numel() == -(-(n * k) // 5)
    assert torch.equal(unpack_base3(b3, (n, k)), w)


def test_layout_bit_positions_and_padding():
    """Byte j of a 256-weight group holds weight j + 64·i in bits 2i (code = w + 1); padding is weight 0."""
    k = GROUP + 3
    w = random_ternary(2, k, seed=7)
    packed = pack_ternary(w)
    codes = (w.to(torch.int16) + 1)
    for row in range(2):
        for j in (0, 1, 17, 63):
            byte = int(packed[row, j])
            for i in range(4):
                assert (byte >> (2 * i)) & 3 == int(codes[row, j + 64 * i])
        # second group: 3 real weights (j = 0, 1, 2 of field 0), the rest padding code 1
        for j in range(64):
            byte = int(packed[row, 64 + j])
            for i in range(4):
                want = int(codes[row, GROUP + j]) if (i == 0 and j < 3) else 1
                assert (byte >> (2 * i)) & 3 == want
    assert torch.equal(unpack_codes(packed, k)[:, k:], torch.ones(2, padded_k(k) - k, dtype=torch.uint8))


def test_int32_word_view_gives_four_consecutive_codes_per_field():
    """What the GEMV reads: little-endian int32 word v of a group, (v >> 2i) & 0x03030303 = codes of weights
    4v..4v+3 + 64·i, one per byte."""
    w = random_ternary(3, GROUP, seed=3)
    words = pack_ternary(w).view(torch.int32)
    codes = (w.to(torch.int32) + 1)
    for v in (0, 5, 15):
        for i in range(4):
            fields = (words[:, v] >> (2 * i)) & 0x03030303
            for b in range(4):
                assert torch.equal((fields >> (8 * b)) & 0xFF, codes[:, 4 * v + b + 64 * i])


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="w: values must be"):
        pack_ternary(torch.tensor([[2, 0]], dtype=torch.int8))
    with pytest.raises(TypeError, match="w: expected an integer tensor"):
        pack_ternary(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="w: expected a 2-D"):
        pack_base3(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="packed: byte values above 242"):
        unpack_base3(torch.tensor([243], dtype=torch.uint8), (1, 5))
    with pytest.raises(ValueError, match="packed: expected 1 bytes"):
        unpack_base3(torch.tensor([0, 0], dtype=torch.uint8), (1, 5))
    with pytest.raises(ValueError, match=r"packed: expected shape \(N, 64\)"):
        unpack_ternary(torch.zeros(2, 63, dtype=torch.uint8), 256)
    with pytest.raises(TypeError, match="packed: expected uint8"):
        unpack_ternary(torch.zeros(2, 64, dtype=torch.int8), 256)

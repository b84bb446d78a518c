"""NeuZip codec on the CPU: bit-exact round trips, lossy bounds, Triton (interpreter) == reference, file checks."""

import os
import struct
import json

import numpy as np
import pytest
import torch

from thrifty.neuzip import CompressedTensor, compress, load, save
from thrifty.neuzip import reference as R
from thrifty.cli import main
from thrifty.neuzip.tensor import _from_streams

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMOLLM2 = os.path.join(os.path.dirname(__file__), "..", "data", "smollm2-135m", "model.safetensors")


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def trained_weights():
    """Weights of a small MLP trained with Adam for 300 steps (a real, non-Gaussian weight distribution)."""
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    teacher = torch.randn(64, 64, generator=g) / 8
    for _ in range(300):
        x = torch.randn(128, 64, generator=g)
        loss = torch.nn.functional.mse_loss(net(x), torch.tanh(x @ teacher))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def special_values(dtype):
    """Zeros, denormals, infinities and NaNs with distinct payloads (as raw bits)."""
    if dtype == torch.float32:
        raw = [0, 0x80000000, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FA5A5A5]
        return torch.tensor(np.array(raw, np.uint32).view(np.int32)).view(torch.float32)
    if dtype == torch.float16:
        raw = [0, 0x8000, 1, 0x83FF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7D5A]
    else:
        raw = [0, 0x8000, 1, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7FA5]
    return torch.tensor(np.array(raw, np.uint16).view(np.int16)).view(dtype)


def cases(dtype, trained):
    g = torch.Generator().manual_seed(1)
    yield "random", (torch.randn(3000, generator=g) * 0.02).to(dtype)
    yield "trained", trained.to(dtype)
    yield "zeros", torch.zeros(777, dtype=dtype)
    yield "specials", special_values(dtype).repeat(37)
    yield "one", torch.tensor([1.5], dtype=dtype)
    yield "odd", (torch.randn(3, 5, 7, generator=g) * 3).to(dtype)
    yield "multi-group", (torch.randn(R.GROUP * R.STEPS * 2 + 1001, generator=g) * 0.02).to(dtype)
    yield "empty", torch.zeros(0, 4, dtype=dtype)
    yield "wide-range", torch.exp(torch.randn(5000, generator=g) * 20).to(dtype) * torch.sign(torch.randn(5000, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_round_trip(dtype, trained_weights):
    for name, x in cases(dtype, trained_weights):
        c = compress(x)
        assert isinstance(c, CompressedTensor)
        assert_same_bits(c.decompress(impl="reference"), x)
        out = torch.empty_like(x)
        assert c.decompress(out=out) is out
        assert_same_bits(out, x)


def test_fields_split_merge():
    for dtype in DTYPES:
        x = torch.cat([special_values(dtype), (torch.randn(100) * 5).to(dtype)])
        s, e, m = R.split_fields(x)
        assert_same_bits(R.merge_fields(s, e, m, dtype, x.shape), x)
        assert s.max() <= 1


def test_ratio_and_entropy_near_bound():
    x = (torch.randn(512, 512, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    c = compress(x)
    assert c.nbytes < x.numel() * 2 and abs(c.ratio - c.nbytes / (x.numel() * 2)) < 1e-12
    assert c.symbol_bits < c.symbol_entropy + 0.06  # Huffman with 12-bit limit: within ~0.05 of Shannon
    assert c.ratio < 0.675  # beats DFloat11's 0.6748 on the same distribution


def test_code_length_limit():
    counts = np.zeros(256, np.int64)
    counts[:40] = 2 ** np.arange(40, dtype=np.int64) // 2 ** 10 + 1  # geometric: unlimited Huffman depth ~39
    lengths = R.code_lengths(counts)
    assert lengths.max() <= R.MAX_CODE_BITS and (lengths[:40] > 0).all()
    assert sum(2.0 ** -int(n) for n in lengths if n) <= 1.0  # Kraft: a prefix code


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_lossy_error_bound(k, trained_weights):
    g = torch.Generator().manual_seed(3)
    x = torch.cat([(torch.randn(20000, generator=g) * 0.05), trained_weights,
                   torch.tensor([3.3895e38, -3.3895e38, 1.0, 1.9999])]).bfloat16()  # bf16 max rounds up -> clamp
    c = compress(x, mantissa_bits=k)
    y = c.decompress(impl="reference")
    if k == 7:
        assert_same_bits(y, x)
        return
    xf, yf = x.float(), y.float()
    normal = xf.abs() >= 2.0 ** -126
    rel = ((yf - xf).abs() / xf.abs())[normal]
    assert rel.max().item() <= 2.0 ** -k and torch.isfinite(yf).all()
    assert (yf[normal].sign() == xf[normal].sign()).all()
    # round to nearest: at most half an ulp of the kept bits, the max-finite clamp too (k=0: 1.99·2^127 -> 2^127)
    assert rel.max().item() <= 2.0 ** -(k + 1)
    # the kept value has only k mantissa bits
    assert (bits(y).numpy().view(np.uint16) & ((1 << (7 - k)) - 1) == 0).all()
    assert c.ratio < (1 + k + 3.2) / 16


def test_lossy_carry_into_exponent():
    x = torch.tensor([1.9921875, -3.984375, 0.99609375], dtype=torch.bfloat16)  # mantissa all ones
    y = compress(x, mantissa_bits=3).decompress()
    assert y.tolist() == [2.0, -4.0, 1.0]
    assert (((y.float() - x.float()).abs() / x.float().abs()) <= 2.0 ** -3).all()


def test_lossy_specials_and_subnormals():
    x = special_values(torch.bfloat16)
    for k in (1, 3):
        y = compress(x, k).decompress()
        xf, yf = x.float(), y.float()
        assert torch.equal(torch.isnan(yf), torch.isnan(xf))
        inf = torch.isinf(xf)
        assert torch.equal(yf[inf], xf[inf])
        sub = (xf.abs() < 2.0 ** -126) & torch.isfinite(xf)
        assert ((yf - xf)[sub].abs() <= 2.0 ** -(k + 1) * 2.0 ** -126).all()
    with pytest.raises(ValueError, match="NaN"):
        compress(x, 0)


def test_triton_interpreter_matches_reference(trained_weights):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test (CPU); the GPU is checked in test_neuzip_cuda.py")
    g = torch.Generator().manual_seed(4)
    xs = [(torch.randn(R.GROUP * 256 + 333, generator=g) * 0.02), trained_weights[:2000],
          special_values(torch.float32).repeat(5), torch.tensor([0.25]),
          torch.exp(torch.randn(3000, generator=g) * 8)]  # wide range: codes longer than 8 bits
    for dtype in DTYPES:
        for x in xs:
            x = x.to(dtype)
            c = compress(x)
            ref = c.decompress(impl="reference")
            assert_same_bits(c.decompress(impl="triton"), ref)
            c = compress(x, pairs=False)  # the single-symbol kernels and their launch options
            assert_same_bits(c.decompress(impl="triton"), ref)
            if dtype != torch.bfloat16:
                continue
            small = c._table("cpu", "small")  # v1/v2 on the same 64-step layout, two-level table
            assert_same_bits(c.decompress(impl="triton", kernel="v2", small_table=small, groups_per_prog=4), ref)
            assert_same_bits(c.decompress(impl="triton", pipelined=False, groups_per_prog=1), ref)
            assert_same_bits(c.decompress(impl="triton", table16=False, groups_per_prog=1), ref)
            assert_same_bits(c.decompress(impl="triton", small=True, groups_per_prog=2), ref)
            assert_same_bits(c.decompress(impl="triton", small=True, table16=False, groups_per_prog=1), ref)
    assert compress(xs[-1].bfloat16()).streams["lengths"].max() > 8
    for k in (0, 1, 3):
        for pairs in (False, True):
            c = compress(xs[0][:3000].bfloat16(), k, pairs=pairs)
            launch = {} if pairs else {"groups_per_prog": 1}
            assert_same_bits(c.decompress(impl="triton", **launch), c.decompress(impl="reference"))


def test_triton_interpreter_lane_lengths():
    """v3 on every lane length, in programs that are full (unmasked loop) and the last one (masked)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test (CPU); the GPU is checked in test_neuzip_cuda.py")
    g = torch.Generator().manual_seed(5)
    for steps in R.LANE_STEPS:
        n = R.GROUP * steps * 3 + 77  # gpp=1: 3 full programs and a partial one; gpp=2: 1 full, 1 partial
        x = (torch.randn(n, generator=g) * 0.02).bfloat16()
        x[:50] = torch.exp(torch.randn(50, generator=g) * 8).bfloat16()
        c = compress(x, steps=steps, pairs=True)
        assert c.steps == steps and c.pairs
        assert_same_bits(c.decompress(impl="reference"), x)
        assert_same_bits(c.decompress(impl="triton"), x)
        c = compress(x, steps=steps, pairs=False)
        assert_same_bits(c.decompress(impl="reference"), x)
        for gpp in (1, 2):
            assert_same_bits(c.decompress(impl="triton", groups_per_prog=gpp), x)
        assert_same_bits(c.decompress(impl="triton", groups_per_prog=1, small=True), x)
        assert_same_bits(c.decompress(impl="triton", kernel="v2"), x)
        n = R.GROUP * steps * 2  # exact multiple: the last program is full but must still run masked
        c = compress(x[:n], steps=steps, pairs=False)
        assert_same_bits(c.decompress(impl="triton", groups_per_prog=1), x[:n])
        assert_same_bits(compress(x[:n], steps=steps, pairs=True).decompress(impl="triton"), x[:n])


@pytest.mark.parametrize("steps", R.LANE_STEPS)
def test_lane_lengths_round_trip(steps, trained_weights):
    for dtype in DTYPES:
        for name, x in cases(dtype, trained_weights):
            if name in ("random", "specials", "one", "multi-group", "empty", "wide-range"):
                c = compress(x, steps=steps)
                lanes = R.GROUP * -(-x.numel() // (R.GROUP * steps))
                assert c.streams["lane_units"].dtype == torch.uint8 and c.streams["lane_units"].numel() == lanes
                assert_same_bits(c.decompress(impl="reference"), x)
    x = (torch.randn(R.GROUP * 256 * 4) * 0.02).bfloat16()
    c = compress(x, steps=steps, pairs=False)
    lanes, groups, unit = x.numel() // steps, x.numel() // (R.GROUP * steps), R.lane_unit(steps)
    # metadata: 1 byte per lane, an int64 per group; lanes padded to whole units of steps / 16 bits
    exact = c.streams["lengths"].numpy().astype(np.int64)[R.split_symbols(R._uint_view(x), x.dtype)[0]].sum()
    padding = int(c._lane_bits().sum()) - exact
    assert 0 <= padding <= (unit - 1) * lanes and c.symbol_bits * x.numel() == exact
    assert c.nbytes == 4 * c.streams["words"].numel() + lanes + 8 * groups + x.numel() + 256
    assert 4 * c.streams["words"].numel() == 4 * (-(-(exact + padding) // 32) + R.WORD_PAD)
    assert (c._lane_bits() % unit == 0).all()


@pytest.mark.parametrize("steps", R.LANE_STEPS)
def test_worst_case_lane_lengths(steps):
    """Lanes of only 12-bit codes (192 units, the most a uint8 must hold) and of only 1-bit codes."""
    lengths = np.zeros(256, np.uint8)
    lengths[:13] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 12]  # a complete prefix code
    g = np.random.default_rng(steps)
    n = R.GROUP * steps * 2 + 100
    sym = np.full(n, 12, np.uint8)
    sym[R.GROUP * steps:] = g.choice([0, 11, 12], n - R.GROUP * steps)  # second group: mixed
    sym[-100:] = 0
    words, lane_len, offs = R.encode_symbols(sym, lengths, steps)
    assert lane_len.dtype == np.uint8 and lane_len[:R.GROUP].tolist() == [192] * R.GROUP
    assert (R.decode_symbols(words, lane_len, offs, lengths, n, steps) == sym).all()
    s = R.Streams(words, lane_len, offs, np.zeros(n, np.uint8), lengths, np.zeros(256, np.int64), steps)
    x = torch.from_numpy((sym.astype(np.int16) << 7)).view(torch.bfloat16)  # sign 0, mantissa 0
    c = _from_streams(s, x, None)
    assert_same_bits(c.decompress(impl="reference"), x)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert_same_bits(c.decompress(impl="triton", groups_per_prog=1), x)


def test_bad_input():
    with pytest.raises(TypeError, match="tensor"):
        compress([1.0, 2.0])
    with pytest.raises(TypeError, match="tensor"):
        compress(torch.arange(5))
    with pytest.raises(TypeError, match="tensor"):
        compress(torch.zeros(3, dtype=torch.float64))
    for k in (2, 8, -1):
        with pytest.raises(ValueError, match="mantissa_bits"):
            compress(torch.zeros(3, dtype=torch.bfloat16), k)
    with pytest.raises(TypeError, match="mantissa_bits"):
        compress(torch.zeros(3, dtype=torch.bfloat16), 1.5)
    with pytest.raises(ValueError, match="mantissa_bits"):
        compress(torch.zeros(3, dtype=torch.float32), 3)
    c = compress(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="impl"):
        c.decompress(impl="cuda")
    with pytest.raises(ValueError, match="out"):
        c.decompress(out=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out"):
        c.decompress(out=torch.zeros(3, dtype=torch.float32))
    for steps in (32, 100, 512):
        with pytest.raises(ValueError, match="steps"):
            compress(torch.zeros(3, dtype=torch.bfloat16), steps=steps)
    with pytest.raises(TypeError, match="steps"):
        compress(torch.zeros(3, dtype=torch.bfloat16), steps=64.0)
    with pytest.raises(ValueError, match="kernel"):
        c.decompress(impl="triton", kernel="v9")


# ----------------------------------------------------------------------------------------------- files
@pytest.fixture()
def saved(tmp_path, trained_weights):
    entries = {"w": compress(trained_weights.bfloat16()), "h": compress(trained_weights[:999].half(), steps=128),
               "lossy": compress(trained_weights.bfloat16(), 1), "old": compress(trained_weights.float(), steps=256),
               "single128": compress(trained_weights[:5000].bfloat16(), steps=128, pairs=False),
               "ids": torch.arange(7)}
    path = tmp_path / "m.nz"
    save(path, entries)
    return path, entries


def _same_entries(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x = a[k].decompress() if isinstance(a[k], CompressedTensor) else a[k]
        y = b[k].decompress() if isinstance(b[k], CompressedTensor) else b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return False
    return True


def test_file_round_trip(saved):
    path, entries = saved
    assert _same_entries(load(path), entries)


def test_file_corruption_fuzz(saved):
    path, entries = saved
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(0)
    for trial in range(60):
        bad = bytearray(data)
        # half the flips in the header (JSON, metadata), half anywhere
        (hsize,) = struct.unpack("<Q", data[:8])
        pos = int(rng.integers(0, 8 + hsize if trial % 2 else len(data)))
        bad[pos] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(bad))
        try:
            got = load(path)
        except ValueError as err:
            assert str(path) in str(err)
            continue
        assert _same_entries(got, entries), f"flip at byte {pos} went unnoticed"  # e.g. JSON whitespace
    for cut in (0, 5, 8, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(bytes(data[:cut]))
        with pytest.raises(ValueError, match=str(path.name)):
            load(path)


def _set_header(path, edit):
    data = path.read_bytes()
    (hsize,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + hsize])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + hsize:])


def test_file_wrong_version_and_foreign(saved, tmp_path):
    path, _ = saved
    _set_header(path, lambda h: h["__metadata__"].update({"thrifty.neuzip.format": "999"}))
    with pytest.raises(ValueError, match="version"):
        load(path)
    from safetensors.torch import save_file
    plain = tmp_path / "plain.safetensors"
    save_file({"a": torch.zeros(3)}, str(plain))
    with pytest.raises(ValueError, match="not a thrifty neuzip file"):
        load(plain)


def _edit_meta(h, name, **kw):
    meta = json.loads(h["__metadata__"]["thrifty.neuzip.tensors"])
    for k, v in kw.items():
        if v is None:
            meta[name].pop(k, None)
        else:
            meta[name][k] = v
    h["__metadata__"]["thrifty.neuzip.tensors"] = json.dumps(meta)


def test_file_older_versions_are_refused(saved):
    """Format 4 is the only version thrifty writes and reads: versions 1-3 (the codec's development before the
    first release, never written by a user) and later ones are refused with the file and the version named."""
    path, entries = saved
    for version in ("1", "2", "3", "5"):
        _set_header(path, lambda h: h["__metadata__"].update({"thrifty.neuzip.format": version}))
        with pytest.raises(ValueError, match=f"{path.name}: neuzip format version '{version}'.* version '4' only"):
            load(path)
    _set_header(path, lambda h: h["__metadata__"].update({"thrifty.neuzip.format": "4"}))
    assert _same_entries(load(path), entries)


def test_file_lane_lengths_are_checked(tmp_path, trained_weights):
    """Each tensor's lane length and lane unit (steps // 16) are stated and checked; a tensor without
    ``lane_unit`` (the uint16 ``lane_bits`` layout of versions 1-2) or with another unit is refused."""
    x = trained_weights.bfloat16()
    path = tmp_path / "w.nz"
    for steps in R.LANE_STEPS:
        save(path, {"w": compress(x, steps=steps)})
        assert load(path)["w"].unit == steps // 16 == R.lane_unit(steps)
    # forged headers: the sizes, the checksum or the lane-unit check no longer fit
    for edit in (dict(steps=128), dict(steps=256), dict(steps=32), dict(lane_unit=1), dict(lane_unit=8),
                 dict(lane_unit=None), dict(lane_unit="4"), dict(lane_unit=True)):
        save(path, {"w": compress(x, steps=64)})
        _set_header(path, lambda h: _edit_meta(h, "w", **edit))
        with pytest.raises(ValueError, match=str(path.name)):
            load(path)


def test_checksum_formula_is_that_of_written_files():
    """The checksum that format 4 files store (dtype, shape, mantissa bits, steps except 256, lane unit, pairs,
    then the streams): fixed values, so that a change of the formula cannot pass unnoticed (files already
    written would stop loading). The values are those of the code before issue #30 removed versions 1-3."""
    def streams(pairs):
        s = {"words": torch.arange(8, dtype=torch.int32) * 977, "lane_units": torch.arange(64, dtype=torch.uint8),
             "group_offsets": torch.tensor([0], dtype=torch.int64), "raw": torch.arange(100, dtype=torch.uint8),
             "lengths": torch.full((256,), 8, dtype=torch.uint8)}
        if pairs:
            s.update(pair_syms=torch.arange(3, dtype=torch.int16), lengths=torch.tensor([1, 2, 2], dtype=torch.uint8))
        return s

    got = [CompressedTensor(streams(pairs), dtype, (10, 10), k, steps=steps).crc32()
           for steps in (64, 128, 256) for pairs in (False, True)
           for dtype, k in ((torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, 3))]
    assert got == [2470646995, 196668017, 1618847249, 3039063612, 2069815178, 2719257152, 1192265229, 2135998263,
                   847846179, 4275320057, 3692583153, 2809149714, 1973057213, 3481540281, 1038707469, 3728545660,
                   2355522442, 2647967512]


def test_file_forged_lane_lengths(tmp_path, trained_weights, monkeypatch):
    """Streams changed together with their checksum (a forgery, not a bit flip) are still rejected."""
    # save() itself refuses to write such streams (it reads its output back); a forger skips that check
    monkeypatch.setattr("thrifty.neuzip.format._verify_written", lambda *a: None)
    x = torch.cat([trained_weights, trained_weights[:5000]]).bfloat16()  # 2 groups at 64 steps
    path = tmp_path / "f.nz"

    def forged(change):
        c = compress(x)
        change(c.streams, "lane_units")
        save(path, {"w": c})  # the checksum is computed over the forged streams
        with pytest.raises(ValueError, match="inconsistent streams"):
            load(path)

    def bump(i, d):
        def change(s, key):
            s[key][i] += d
        return change

    # (not caught without decoding: two lanes of one group with lengths moved between them, same sum)
    def offsets(s, key):
        s["group_offsets"][1] += 4

    def overlong(s, key):  # more than 12 bits per symbol, total kept by the last lane
        s[key][:2] = s[key][:2] + 200
        s[key][-1] = 0

    for change in (bump(0, 1), bump(-1, -40), offsets, overlong):
        forged(change)


def test_cli_round_trip(tmp_path, capsys, trained_weights):
    from safetensors.torch import load_file, save_file
    model = {"layer.weight": trained_weights[:4096].reshape(64, 64).bfloat16().contiguous(),
             "layer.bias": trained_weights[:64].clone(), "norm": torch.ones(64, dtype=torch.float16),
             "steps": torch.tensor([3, 4])}
    src, mid, dst = tmp_path / "m.safetensors", tmp_path / "m.nz", tmp_path / "back.safetensors"
    save_file(model, str(src))
    assert main(["compress", str(src), str(mid)]) == 0
    summary = capsys.readouterr().out
    assert "before" in summary and "bits per exponent" in summary and "entropy" in summary
    assert main(["decompress", str(mid), str(dst)]) == 0
    back = load_file(str(dst))
    assert all(torch.equal(back[k].view(torch.uint8), model[k].view(torch.uint8)) for k in model)
    assert main(["compress", str(src), str(mid), "--mantissa-bits", "3", "--steps", "128"]) == 0
    assert main(["decompress", str(mid), str(dst)]) == 0
    capsys.readouterr()  # drop the compress/decompress summaries above
    mid.write_bytes(mid.read_bytes()[:-10])
    assert main(["decompress", str(mid), str(dst)]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and str(mid) in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not os.path.exists(SMOLLM2), reason="SmolLM2 not converted (thrifty setup)")
def test_real_smollm2_tensors():
    """Secondary real set: SmolLM2-135M (Q4_1-dequantized, so exponent statistics are distorted)."""
    from safetensors import safe_open
    with safe_open(SMOLLM2, "pt") as f:
        names = [n for n in f.keys() if "layers.3." in n][:4]
        for n in names:
            w = f.get_tensor(n)
            for x in (w, w.bfloat16()):
                assert_same_bits(compress(x).decompress(), x)


# ------------------------------------------------------------------------------------- pair symbols
def test_limited_lengths_is_a_prefix_code_no_worse_than_halving():
    """Package-merge: lengths <= 12 with Kraft sum <= 1, never costlier than the count-halving limit; at most
    4096 symbols (a forged or too-varied histogram raises)."""
    g = np.random.default_rng(0)
    for counts in (np.bincount(g.geometric(0.3, 50000)), np.bincount(np.minimum(g.pareto(0.7, 10 ** 5), 3000).astype(int)),
                   np.ones(4096, np.int64),
                   np.array([5]), np.array([3, 0, 7])):
        L = R.limited_lengths(counts).astype(np.int64)
        assert L.max() <= R.MAX_CODE_BITS and ((L > 0) == (counts > 0)).all()
        assert (2.0 ** -L[L > 0]).sum() <= 1
        assert (counts * L).sum() <= (counts * R.code_lengths(counts).astype(np.int64)).sum()
    with pytest.raises(ValueError, match="counts"):
        R.limited_lengths(np.ones(4097, np.int64))


def test_pair_symbols_round_trip_and_choice(trained_weights):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(R.GROUP * 64 * 3 + 333, generator=g) * 0.02)
    for dtype in (torch.bfloat16, torch.float32):
        for n in (x.numel(), 1, 2, 3, 129):  # odd ends: the last pair's second symbol is padding
            c = compress(x[:n].to(dtype), pairs=True)
            assert c.pairs and (n > 3 or compress(x[:n].to(dtype)).pairs), (dtype, n)
            assert_same_bits(c.decompress(impl="reference"), x[:n].to(dtype))
    for k in (0, 1, 3):
        c = compress(x.bfloat16(), k, pairs=True)
        assert c.pairs
        assert_same_bits(c.decompress(impl="reference"), R.round_mantissa(x.bfloat16(), k))
    big = (torch.randn(512, 512, generator=g) * 0.02).bfloat16()  # large enough for the pair code to pay
    assert compress(big).pairs and not compress(big, pairs=False).pairs
    # fp16 symbols carry 3 mantissa bits: too many distinct pairs, single symbols are kept
    h = (torch.randn(1000, 1000, generator=g) * 0.02).half()
    assert not compress(h).pairs
    with pytest.raises(ValueError, match="pairs"):
        compress(h, pairs=True)
    with pytest.raises(TypeError, match="pairs"):
        compress(h, pairs="yes")
    # the pair code costs at most PAIR_SIZE_SLACK more than single symbols (here: on real weights)
    w = trained_weights.bfloat16()
    assert compress(w).nbytes <= R.PAIR_SIZE_SLACK * compress(w, pairs=False).nbytes


def test_pair_files_are_checked(tmp_path):
    x = (torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    c = compress(x)
    assert c.pairs
    save(tmp_path / "a.safetensors", {"w": c})
    assert_same_bits(load(tmp_path / "a.safetensors")["w"].decompress(), x)
    # the same file claiming version 3 (an older version: refused as such), or with the pair list out of
    # order: refused
    data = (tmp_path / "a.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + size])
    for version, swap, says in (("3", False, "version '3'"), ("4", True, "pair")):
        h = json.loads(json.dumps(header))
        h["__metadata__"]["thrifty.neuzip.format"] = version
        body = bytearray(data[8 + size:])
        if swap:  # swap the first two pair symbols (the checksum is recomputed: a forgery, not a bit flip)
            lo, _ = h["w::pair_syms"]["data_offsets"]
            body[lo: lo + 4] = body[lo + 2: lo + 4] + body[lo: lo + 2]
            streams = dict(c.streams, pair_syms=torch.from_numpy(np.frombuffer(bytes(body[lo: lo + 2 * len(
                c.streams["pair_syms"])]), np.int16).copy()))
            tensors = json.loads(h["__metadata__"]["thrifty.neuzip.tensors"])
            tensors["w"]["crc32"] = CompressedTensor(streams, c.dtype, c.shape, None, steps=c.steps).crc32()
            h["__metadata__"]["thrifty.neuzip.tensors"] = json.dumps(tensors)
        raw = json.dumps(h).encode()
        (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(body))
        with pytest.raises(ValueError, match=says):
            load(tmp_path / "b.safetensors")


def test_block_pack_with_pairs_interpreter():
    """The block kernel on pair tensors (odd sizes, the 32-bit store path and the element path), next to
    single-symbol ones, fp32 and lossy pairs, and into a buffer that is not 4-byte aligned."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter test (CPU)")
    from thrifty.neuzip.block_decode import BlockPack

    g = torch.Generator().manual_seed(8)
    rnd = lambda n: torch.randn(n, generator=g) * 0.02  # noqa: E731
    cases = [([rnd(R.GROUP * 64 * 2 + 5), rnd(333), rnd(R.GROUP * 64 * 3)], None, torch.bfloat16, (1,)),
             ([rnd(R.GROUP * 64 + 7), rnd(3)], 3, torch.bfloat16, ()),
             ([rnd(R.GROUP * 64 * 2 + 1), rnd(10)], None, torch.float32, ())]
    for xs, k, dtype, singles in cases:
        xs = [x.to(dtype) for x in xs]
        cts = [compress(x, k, pairs=i not in singles) for i, x in enumerate(xs)]
        assert [c.pairs for c in cts] == [i not in singles for i in range(len(xs))]
        pack = BlockPack(cts)
        want = torch.cat([c.decompress(impl="reference").reshape(-1) for c in cts])
        out = torch.empty(pack.total_numel + 1, dtype=dtype)
        for buf in (out[: pack.total_numel], out[1:]):  # aligned, and shifted by one element
            buf.zero_()
            pack.decode_into(buf, impl="triton")
            assert_same_bits(buf, want)
        rows = pack.launch_table("cpu")[0]
        assert rows[:, 10].any() and not pack.launch_table("cpu", aligned=False)[0][rows[:, 12] == 1, 10].any()


# --------------------------------------------------------------- host code construction (issue 26 speed-up)
def _old_code_lengths(counts, max_bits=R.MAX_CODE_BITS):
    """The heap Huffman with count halving as it was before the vectorized rewrite (the oracle)."""
    import heapq
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    lengths = np.zeros(len(counts), dtype=np.uint8)
    if len(present) <= 1:
        lengths[present] = 1
        return lengths
    c = counts.copy()
    while True:
        heap = [(int(c[s]), int(s), [int(s)]) for s in present]
        heapq.heapify(heap)
        depth = np.zeros(len(counts), dtype=np.int64)
        while len(heap) > 1:
            w1, t1, a = heapq.heappop(heap)
            w2, t2, b = heapq.heappop(heap)
            depth[a + b] += 1
            heapq.heappush(heap, (w1 + w2, min(t1, t2), a + b))
        if depth.max() <= max_bits:
            lengths[present] = depth[present]
            return lengths
        c[present] = np.maximum(c[present] >> 1, 1)


def _old_canonical_codes(lengths):
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(len(lengths), dtype=np.uint32)
    present = np.flatnonzero(lengths)
    code, prev = 0, 0
    for s in present[np.lexsort((present, lengths[present]))]:
        code <<= int(lengths[s]) - prev
        codes[s] = code
        code, prev = code + 1, int(lengths[s])
    return codes


def _old_decode_table(lengths):
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = _old_canonical_codes(lengths)
    table = np.full(1 << R.MAX_CODE_BITS, 1, dtype=np.int32)
    for s in np.flatnonzero(lengths):
        n = int(lengths[s])
        lo = int(codes[s]) << (R.MAX_CODE_BITS - n)
        table[lo: lo + (1 << (R.MAX_CODE_BITS - n))] = (int(s) << 4) | n
    return table


def _histograms():
    """Symbol and pair histograms with ties, limit-exceeding depths, lone symbols and incomplete codes."""
    g = np.random.default_rng(11)
    out = [np.bincount(g.geometric(p, 20000), minlength=256)[:256] for p in (0.05, 0.3, 0.6)]
    geo = np.zeros(256, np.int64)
    geo[:40] = 2 ** np.arange(40, dtype=np.int64) // 2 ** 10 + 1  # needs many halving rounds
    out += [geo, np.eye(256, dtype=np.int64)[17], np.ones(256, np.int64), g.integers(0, 4, 256)]
    x = (torch.randn(300, 301, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16()
    sym = R.split_symbols(R._uint_view(x), x.dtype)[0]
    out += [np.bincount(sym, minlength=256), np.bincount(R.pair_symbols(sym), minlength=R.PAIR_SYMBOLS)]
    return out


def test_host_code_functions_match_the_former_loops():
    """code_lengths, canonical_codes and decode_table (rewritten without per-symbol NumPy ops) give exactly the
    former loops' results, so every stored code and table is unchanged."""
    for counts in _histograms():
        codes = [R.limited_lengths(counts)]
        if len(counts) == 256:
            codes.append(R.code_lengths(counts))
            assert (codes[-1] == _old_code_lengths(counts)).all()
        for lengths in codes:
            assert (R.canonical_codes(lengths) == _old_canonical_codes(lengths)).all()
            assert (R.decode_table(lengths) == _old_decode_table(lengths)).all()
    incomplete = np.zeros(256, np.uint8)
    incomplete[[3, 9]] = [2, 3]  # Kraft 3/8: the table's tail keeps its filler
    assert (R.decode_table(incomplete) == _old_decode_table(incomplete)).all()


def test_block_encoder_pair_choice_matches_reference():
    """The block encoder's pair-code choice on the occurring pairs only equals reference.choose_pair_code on the
    full 65536-bin row (lengths and the choice), incl. one pair, no pair and > 4096 pairs."""
    from thrifty.neuzip.encode_kernel import _choose_pair_code

    g = np.random.default_rng(3)
    rows = [h for h in _histograms() if len(h) == R.PAIR_SYMBOLS]
    one = np.zeros(R.PAIR_SYMBOLS, np.int64)
    one[40000] = 7
    rows += [np.zeros(R.PAIR_SYMBOLS, np.int64), one,
             g.integers(0, 3, R.PAIR_SYMBOLS),
             (g.random(R.PAIR_SYMBOLS) < 0.01) * g.integers(1, 10 ** 6, R.PAIR_SYMBOLS)]
    x = (torch.randn(512, 257, generator=torch.Generator().manual_seed(6)) * 0.02).bfloat16()
    sym = R.split_symbols(R._uint_view(x), x.dtype)[0]
    rows.append(np.bincount(R.pair_symbols(sym), minlength=R.PAIR_SYMBOLS))
    for pair in rows:
        sq = np.asarray(pair, np.int64).reshape(256, 256)
        s = sq.sum(axis=1) + sq.sum(axis=0) if pair.sum() else np.ones(256, np.int64)
        for single in (s, np.ones(256, np.int64) * 10 ** 6):
            lengths = R.code_lengths(single)
            want = R.choose_pair_code(pair, lengths, single)
            got = _choose_pair_code(pair.astype(np.int32), lengths, single)
            assert (want is None) == (got is None)
            if want is not None:
                assert got.dtype == want.dtype and np.array_equal(got, want)


def _old_meta_rows(pack, gpp, aligned):
    """BlockPack's launch rows as the former per-program Python loop built them (the oracle)."""
    import math
    rows = []
    for i, n in enumerate(pack.numels):
        g = R.n_groups(n, pack.steps)
        progs = math.ceil(g / gpp)
        n_full = min(n // (gpp * R.GROUP * pack.steps), progs - 1)
        unmasked = not pack.pairs[i] or (aligned and pack.offsets[i] % 2 == 0)
        table_at = sum(p == pack.pairs[i] for p in pack.pairs[:i]) << R.MAX_CODE_BITS
        for p in range(progs):
            rows.append([p, pack.bases["words"][i], pack.bases["lane_units"][i], pack.bases["group_offsets"][i],
                         pack.bases["raw"][i], table_at, pack.offsets[i], n, g * R.GROUP, pack.sizes["words"][i],
                         int(p < n_full and unmasked), pack.sizes["raw"][i], int(pack.pairs[i])])
    return torch.tensor(rows, dtype=torch.int64)


def test_launch_rows_and_tables_match_the_former_loops():
    """The NumPy launch rows equal the former loop's (mixed pair / single tensors, odd offsets, both launch
    shapes, aligned or not), and decode tables from the encoder's host codes equal those read back."""
    from thrifty.neuzip.block_decode import BlockPack

    g = torch.Generator().manual_seed(9)
    sizes = [R.GROUP * 64 * 9 + 5, 333, R.GROUP * 64 * 3, R.GROUP * 64 * 4 + 1, 64 * 64]
    xs = [(torch.randn(n, generator=g) * 0.02).bfloat16() for n in sizes]
    cts = [compress(x, pairs=i not in (1, 3)) for i, x in enumerate(xs)]
    pack = BlockPack(cts)
    for gpp in (1, 4):
        for aligned in (True, False):
            groups = [R.n_groups(n, pack.steps) for n in pack.numels]
            rows = pack._meta_rows(groups, gpp, aligned)
            assert rows.dtype == torch.int64 and torch.equal(rows, _old_meta_rows(pack, gpp, aligned))
    host = BlockPack(cts)
    host.replace([c.streams for c in cts], [c.code_lengths() for c in cts])
    host.tensor = None  # the tables must come from the host codes, not from the streams
    for a, b in zip(host.kernel_tables("cpu"), pack.kernel_tables("cpu")):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="code_lengths"):
        pack.replace([c.streams for c in cts], [cts[0].code_lengths()])

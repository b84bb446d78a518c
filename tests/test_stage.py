"""Staging in parts: every part travels alone, the sums are checked, a corrupted part is named and refused."""

import json

import pytest

from thrifty.stage import next_part, pack, receive


@pytest.fixture
def payload(tmp_path):
    a = tmp_path / "src" / "a.bin"
    a.parent.mkdir()
    a.write_bytes(bytes(range(256)) * 10_000)  # 2.5 MB: three 1-MiB parts
    b = tmp_path / "src" / "manifest.json"
    b.write_text(json.dumps({"x": 1}))
    return {"corpus/a.bin": a, "corpus/manifest.json": b}


def test_parts_round_trip(tmp_path, payload):
    stage, box = tmp_path / "stage", tmp_path / "box"
    index = pack(stage, payload, part_mib=1)
    assert len(index["parts"]) == 3
    names = []
    while (name := next_part(stage)) is not None:
        names.append(name)
        carried = list((stage / "carry").glob("part-*"))
        assert len(carried) == 1  # one part per device call
        msg = receive(stage / "carry", box)
    assert names == ["part-000", "part-001", "part-002"]
    assert msg.startswith("unpacked 2 files")
    assert (box / "corpus" / "a.bin").read_bytes() == payload["corpus/a.bin"].read_bytes()


def test_corrupted_part_is_refused(tmp_path, payload):
    stage, box = tmp_path / "stage", tmp_path / "box"
    pack(stage, payload, part_mib=1)
    for _ in range(3):
        next_part(stage)
        part = next((stage / "carry").glob("part-*"))
        if part.name == "part-001":
            data = bytearray(part.read_bytes())
            data[100] ^= 0xFF
            part.write_bytes(bytes(data))
        try:
            receive(stage / "carry", box)
        except ValueError as e:
            assert "part-001" in str(e) and "sha256" in str(e)
            break
    else:
        pytest.fail("corrupted part was accepted")
    assert not (box / "corpus").exists()


def test_part_size_is_checked(tmp_path, payload):
    with pytest.raises(ValueError, match="part_mib"):
        pack(tmp_path / "s", payload, part_mib=64)

"""Staging the real model and the tokenized corpus onto the GPU box, which takes at most 64 MiB per call.

Here: ``thrifty stage pack`` writes the payload (the SmolLM2 GGUF and the corpus token files) as one tar split
into parts of ``--part-mib`` MiB under ``.stage/``, with an index of SHA-256 sums. Then one device call per
part, each carrying only that part (``thrifty stage next`` moves the next part into ``.stage/carry/``):
``python3 -m thrifty.stage receive .stage/carry`` on the box stores the part in ``$THRIFTY_DATA/.incoming``
(ignored files survive while the box stays warm); when every part has arrived it checks every sum and unpacks.
A corrupted or missing part is reported by name before anything is unpacked.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

from .paths import data_dir, repo_root

INDEX = "index.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_payload() -> dict[str, Path]:
    """archive name -> local file: the GGUF (converted on the box in ~30 s) and the corpus split files."""
    from .pretrained import GGUF_NAME, find_gguf

    files = {f"models/{GGUF_NAME}": find_gguf()}
    corpus = data_dir() / "corpus"
    if not corpus.is_dir():
        raise FileNotFoundError(f"no corpus at {corpus}: run `thrifty setup` first")
    for f in sorted(corpus.iterdir()):
        if f.is_file() and f.suffix in (".bin", ".json"):
            files[f"corpus/{f.name}"] = f
    return files


def pack(dest: Path, payload: dict[str, Path], part_mib: int = 60) -> dict:
    """Writes ``dest/part-XXX`` (each ≤ part_mib MiB) and ``dest/index.json``; returns the index."""
    if part_mib <= 0 or part_mib > 63:
        raise ValueError(f"part_mib: expected 1..63 (a device call carries at most 64 MiB), got {part_mib}")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("part-*"):
        old.unlink()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, path in payload.items():
            tar.add(str(path), arcname=name)
    blob = buf.getvalue()
    size = part_mib << 20
    parts = []
    for i in range(0, len(blob), size):
        p = dest / f"part-{i // size:03d}"
        p.write_bytes(blob[i:i + size])
        parts.append({"name": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)})
    index = {"parts": parts, "total_bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
             "files": sorted(payload)}
    (dest / INDEX).write_text(json.dumps(index, indent=1))
    return index


def next_part(stage: Path) -> str | None:
    """Moves the next part not yet sent into ``stage/carry/`` (with the index); returns its name or None."""
    index = json.loads((stage / INDEX).read_text())
    carry = stage / "carry"
    sent = set(json.loads((stage / "sent.json").read_text())) if (stage / "sent.json").exists() else set()
    if carry.is_dir():
        for old in carry.glob("part-*"):
            sent.add(old.name)
        shutil.rmtree(carry)
    carry.mkdir()
    shutil.copy(stage / INDEX, carry / INDEX)
    (stage / "sent.json").write_text(json.dumps(sorted(sent)))
    for part in index["parts"]:
        if part["name"] not in sent:
            shutil.copy(stage / part["name"], carry / part["name"])
            return part["name"]
    return None


def receive(carry: Path, out: Path | None = None) -> str:
    """On the box: stores the carried part; when all are there, verifies and unpacks into the data dir."""
    out = out or data_dir()
    incoming = out / ".incoming"
    incoming.mkdir(parents=True, exist_ok=True)
    index = json.loads((carry / INDEX).read_text())
    shutil.copy(carry / INDEX, incoming / INDEX)
    for p in carry.glob("part-*"):
        shutil.copy(p, incoming / p.name)
    missing = [p["name"] for p in index["parts"] if not (incoming / p["name"]).exists()]
    if missing:
        return f"have {len(index['parts']) - len(missing)}/{len(index['parts'])} parts; missing {missing}"
    for p in index["parts"]:
        got = _sha256(incoming / p["name"])
        if got != p["sha256"]:
            (incoming / p["name"]).unlink()
            raise ValueError(f"{p['name']}: sha256 mismatch (expected {p['sha256'][:12]}…, got {got[:12]}…); "
                             "removed, send it again")
    blob = b"".join((incoming / p["name"]).read_bytes() for p in index["parts"])
    if hashlib.sha256(blob).hexdigest() != index["sha256"]:
        raise ValueError("assembled archive: sha256 mismatch; send all parts again")
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(out, filter="data")
    shutil.rmtree(incoming)
    return f"unpacked {len(index['files'])} files into {out}"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``pack`` / ``next`` / ``receive`` sub-verbs, on ``thrifty stage`` or ``python -m thrifty.stage``."""
    dest = str((repo_root() or Path.cwd()) / ".stage")
    sub = ap.add_subparsers(dest="step", required=True)
    p = sub.add_parser("pack", help="split model + corpus into parts under .stage/")
    p.add_argument("--dest", default=dest)
    p.add_argument("--part-mib", type=int, default=60)
    n = sub.add_parser("next", help="put the next unsent part into .stage/carry/")
    n.add_argument("--dest", default=dest)
    r = sub.add_parser("receive", help="(on the GPU box) take the carried part")
    r.add_argument("carry")
    ap.set_defaults(run=run)


def run(args) -> int:
    if args.step == "pack":
        index = pack(Path(args.dest), default_payload(), args.part_mib)
        print(f"{len(index['parts'])} parts, {index['total_bytes'] / 2**20:.1f} MiB in {args.dest}")
    elif args.step == "next":
        name = next_part(Path(args.dest))
        print(name or "all parts sent")
    else:
        print(receive(Path(args.carry)))
    return 0


def main(argv=None) -> int:
    """``python3 -m thrifty.stage receive DIR`` on the GPU box, where the ``thrifty`` command is not installed."""
    ap = argparse.ArgumentParser(prog="thrifty stage", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

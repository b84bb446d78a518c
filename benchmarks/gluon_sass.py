"""Static SASS of the Gluon attention kernel's tile loops, per structure, on a machine without a GPU (issue #28).

Compiles the Gluon attention kernel (the one ``gluon_kernel.launch`` runs) for sm_90 with the launcher's
constexprs, through the compile table CI uses (``tests/sm90_kernels.py``'s ``gluon_entry``; that table names
every kernel of the library, so this script names none), disassembles it with Triton's bundled ``cuobjdump``
and counts, for each consumer's KV loops (unmasked interior tiles, masked diagonal / ragged tiles), the
instructions one warp issues per tile, the MUFU.EX2 among them, and that count per score a thread owns
(BLOCK_M·BLOCK_N / 128 per tile). D=64 is bound by instruction issue (NOTES.md, "The Gluon kernel"), so
instructions per score is the figure of merit here.

    python benchmarks/gluon_sass.py [--dims 64] [--causal] [--variants '{}' '{"block_m": 128}' ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import sm90_kernels as S  # noqa: E402  (the compile entries: the launcher's constexprs)

from thrifty.attention import gluon_kernel as G  # noqa: E402

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([S.cuda_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in map(LINE.search, text.splitlines()) if m]


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]


def tile_loops(code):
    """Bodies of the KV loops: a conditional branch back over a body holding MUFU.EX2. (The mbarrier retry
    paths sit after the kernel's end and jump back with a plain BRA; they are not loops of the schedule.)"""
    loops = []
    for addr, ins in code:
        m = re.match(r"@!?U?P\w+\s+BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            body = [i for a, i in code if int(m.group(1), 16) <= a <= addr]
            if any(opcode(i) == "MUFU.EX2" for i in body):
                loops.append(body)
    return loops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--variants", nargs="*", default=["{}", json.dumps(G.SMALL_D64_TILES)])
    args = ap.parse_args(argv)
    rows = []
    for D in map(int, args.dims.split(",")):
        for variant in map(json.loads, args.variants):
            spec = S.gluon_entry(D, args.causal, torch.bfloat16, False, False, variant)
            k = S.compile_kernel(spec)
            res = S.resources(k.asm["cubin"])
            cfg = dict(G.gluon_config(D, args.causal), **variant)
            scores = cfg["block_m"] * cfg["block_n"] // 128  # per thread and tile (a warpgroup is 128 threads)
            for i, body in enumerate(tile_loops(sass(k.asm["cubin"]))):
                ops = collections.Counter(map(opcode, body))
                rows.append(dict(label=spec.label, loop=i, instructions=len(body), ex2=ops["MUFU.EX2"],
                                 per_score=round(len(body) / scores, 2), stack=res.get("stack"),
                                 shared=k.metadata.shared, top=ops.most_common(8)))
                print(f"{spec.label:70s} loop {i}: {len(body):5d} instr/warp/tile, {ops['MUFU.EX2']:4d} ex2, "
                      f"{len(body) / scores:5.2f} per score  (stack {res.get('stack')} B, "
                      f"shared {k.metadata.shared} B)", flush=True)
    return rows


if __name__ == "__main__":
    main()

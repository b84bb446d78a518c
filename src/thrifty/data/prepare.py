"""Building a corpus: :func:`prepare_corpus` fetches Debian documentation packages (``debian.py``) or reads a
folder, cleans them to prose (``clean.py``), splits the documents deterministically (:func:`split_of`) and
tokenizes them into flat ``uint16`` token files in the layout of ``layout.py``, with a manifest that makes the
build idempotent. ``text.load_corpus_text`` reads its cleaned text back; ``dataset.TokenDataset`` reads its
tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from .._checks import check_range
from .clean import CLEANER_VERSION, clean_file
from .debian import DEBIAN_PACKAGES, DEBIAN_SOURCES, DebianSource, fetch_debian_package, read_license, unpacked_deb
from .layout import FORMAT_VERSION, SPLITS, file_sha256
from .tokenizer import as_tokenizer, eos_token_of

VALIDATION_FRACTION = 0.03  # ~3%: ~300K tokens of validation from ~50 MB of text
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".html", ".htm")


def split_of(doc_id: str, validation_fraction: float = VALIDATION_FRACTION) -> str:
    """"validation" or "train", from a hash of the document's id: stable across runs, machines and subsets."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return "validation" if h < validation_fraction * 2**64 else "train"


def _clean_job(job: tuple[str, str, Optional[str]]) -> tuple[str, str]:
    doc_id, path, kind = job
    return doc_id, clean_file(Path(path), kind)


def _iter_cleaned(jobs: list[tuple[str, str, Optional[str]]], progress: bool, desc: str) -> Iterator[tuple[str, str]]:
    """Cleans files in parallel (one process per core; HTML parsing is pure Python), in input order."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc=desc, unit="file", disable=not progress, leave=False)
    procs = min(os.cpu_count() or 1, 8)
    try:
        if procs > 1 and len(jobs) > 16 and sys.platform.startswith("linux"):
            import multiprocessing as mp

            with mp.get_context("fork").Pool(procs) as pool:
                for item in pool.imap(_clean_job, jobs, chunksize=4):
                    bar.update()
                    yield item
        else:
            for job in jobs:
                bar.update()
                yield _clean_job(job)
    finally:
        bar.close()


def _write_source_text(name: str, jobs, text_path: Path, cap_bytes: Optional[int], val_frac: float,
                       progress: bool) -> dict:
    """Cleans a source's files into ``text_path`` (JSON lines); exact repeated paragraphs are dropped (page
    boilerplate). Stops at ``cap_bytes`` of cleaned text. Returns the per-source statistics."""
    seen: set[bytes] = set()
    stats = {"documents": {s: 0 for s in SPLITS}, "text_bytes": {s: 0 for s in SPLITS}, "files": len(jobs)}
    total = 0
    tmp = text_path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for doc_id, text in _iter_cleaned(jobs, progress, f"cleaning {name}"):
            pars = []
            for p in text.split("\n\n") if text else ():
                key = hashlib.blake2b(p.encode(), digest_size=8).digest()
                if key not in seen:
                    seen.add(key)
                    pars.append(p)
            if not pars:
                continue
            text = "\n\n".join(pars)
            nbytes = len(text.encode())
            split = split_of(doc_id, val_frac)
            f.write(json.dumps({"id": doc_id, "split": split, "text": text}, ensure_ascii=False) + "\n")
            stats["documents"][split] += 1
            stats["text_bytes"][split] += nbytes
            total += nbytes
            if cap_bytes is not None and total >= cap_bytes:
                break
    os.replace(tmp, text_path)
    return stats


def _debian_jobs(src: DebianSource, tree: Path) -> list[tuple[str, str, Optional[str]]]:
    files = set()
    for g in src.globs:
        files.update(p for p in tree.glob(g) if p.is_file())
    jobs = []
    for p in sorted(files):
        rel = p.relative_to(tree).as_posix()
        if src.exclude and re.search(src.exclude, "/" + rel):
            continue
        jobs.append((f"{src.package}/{rel}", str(p), None))
    return jobs


def _dir_jobs(corpus_dir: Path) -> list[tuple[str, str, Optional[str]]]:
    files = sorted(p for p in corpus_dir.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    return [(f"dir:{corpus_dir.name}/{p.relative_to(corpus_dir).as_posix()}", str(p), None) for p in files]


def _dir_fingerprint(corpus_dir: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(corpus_dir.rglob("*")):
        if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES:
            st = p.stat()
            h.update(f"{p.relative_to(corpus_dir).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _resolve_sources(sources) -> list[str]:
    if isinstance(sources, str):
        sources = (sources,)
    if not isinstance(sources, (tuple, list)):
        raise TypeError(f"sources: expected a tuple of source names, got {type(sources).__name__}")
    names: list[str] = []
    for s in sources:
        if s == "debian":
            names.extend(DEBIAN_PACKAGES)
        elif s in DEBIAN_PACKAGES:
            names.append(s)
        else:
            raise ValueError(f"sources: unknown source {s!r}; expected 'debian' or some of {list(DEBIAN_PACKAGES)}")
    return list(dict.fromkeys(names))


def _manifest_ok(out_dir: Path, request: dict) -> bool:
    """True when ``out_dir`` already holds a complete corpus built for the same request (sizes and sha256 checked)."""
    path = out_dir / "manifest.json"
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        return False
    if manifest.get("request") != request:
        return False
    for split in SPLITS:
        info = manifest["splits"][split]
        f = out_dir / info["file"]
        if not f.is_file() or f.stat().st_size != 2 * info["tokens"] or file_sha256(f) != info["sha256"]:
            return False
    return True


def prepare_corpus(
    out_dir=None,
    sources: Sequence[str] = ("debian",),
    corpus_dir=None,
    tokenizer=None,
    max_mb: Optional[float] = None,
    progress: bool = True,
) -> Path:
    """Builds a tokenized corpus in ``out_dir`` (default ``<data>/corpus``) and returns that folder.

    ``sources``: "debian" (every package in ``DEBIAN_PACKAGES``), or some of those package names, or () to use
    only ``corpus_dir``, a folder of .txt/.md/.rst/.html files cleaned the same way. ``max_mb`` caps the cleaned
    text (MB, shared equally by the sources). Idempotent: returns at once when the manifest says the same build
    is already there and the token files match their checksums.
    """
    from ..paths import data_dir

    out = Path(out_dir) if out_dir is not None else data_dir() / "corpus"
    names = _resolve_sources(sources)
    cdir = None
    if corpus_dir is not None:
        cdir = Path(corpus_dir)
        if not cdir.is_dir():
            raise ValueError(f"corpus_dir: {cdir} is not a folder")
    if not names and cdir is None:
        raise ValueError("sources: empty and no corpus_dir given; nothing to build a corpus from")
    if max_mb is not None:
        check_range("max_mb", max_mb, 0, float("inf"), lo_open=True)
    tok = as_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > 2**16:
        raise ValueError(f"tokenizer: vocab size {vocab} does not fit the uint16 token files (max 65536)")
    eos_name, eos_id = eos_token_of(tok)
    request = {
        "format": FORMAT_VERSION,
        "cleaner": CLEANER_VERSION,
        "sources": names,
        "corpus_dir": str(cdir.resolve()) if cdir else None,
        "corpus_dir_fingerprint": _dir_fingerprint(cdir) if cdir else None,
        "max_mb": max_mb,
        "validation_fraction": VALIDATION_FRACTION,
        "tokenizer_sha256": hashlib.sha256(tok.to_str().encode()).hexdigest(),
    }
    if _manifest_ok(out, request):
        return out

    out.mkdir(parents=True, exist_ok=True)
    (out / "text").mkdir(exist_ok=True)
    n_sources = len(names) + (cdir is not None)
    cap = None if max_mb is None else int(max_mb * 1e6 / n_sources)
    records = []
    # 1. Clean every source into text/<name>.jsonl.
    for name in names:
        src = next(s for s in DEBIAN_SOURCES if s.package == name)
        deb = fetch_debian_package(name)
        with unpacked_deb(deb) as (tree, version):
            licence, all_licences, copyright_text = read_license(tree, name, src.license)
            (out / "licenses").mkdir(exist_ok=True)
            (out / "licenses" / f"{name}.copyright").write_text(copyright_text)
            stats = _write_source_text(name, _debian_jobs(src, tree), out / "text" / f"{name}.jsonl", cap,
                                       VALIDATION_FRACTION, progress)
        records.append({"name": name, "package": name, "version": version, "license": licence,
                        "licenses_in_copyright_file": all_licences,
                        "copyright_file": f"licenses/{name}.copyright", "deb": deb.name, **stats})
    if cdir is not None:
        name = f"dir-{cdir.name}"
        stats = _write_source_text(name, _dir_jobs(cdir), out / "text" / f"{name}.jsonl", cap,
                                   VALIDATION_FRACTION, progress)
        records.append({"name": name, "package": None, "version": None, "license": "user-supplied",
                        "path": str(cdir.resolve()), **stats})

    # 2. Tokenize into one flat uint16 file per split; every document ends with EOS.
    from tqdm.auto import tqdm

    tmp_files = {s: out / f"{s}.bin.tmp" for s in SPLITS}
    handles = {s: open(p, "wb") for s, p in tmp_files.items()}
    counts = {s: 0 for s in SPLITS}
    try:
        for rec in records:
            rec["tokens"] = {s: 0 for s in SPLITS}
            path = out / "text" / f"{rec['name']}.jsonl"
            total = sum(rec["text_bytes"].values())
            with open(path, encoding="utf-8") as f, tqdm(total=total, unit="B", unit_scale=True, leave=False,
                                                         desc=f"tokenizing {rec['name']}", disable=not progress) as bar:
                batch: list[dict] = []
                size = 0
                for line in f:
                    doc = json.loads(line)
                    batch.append(doc)
                    size += len(doc["text"])
                    if size >= 4_000_000 or len(batch) >= 512:
                        _encode_into(tok, batch, eos_id, handles, counts, rec["tokens"], bar)
                        batch, size = [], 0
                if batch:
                    _encode_into(tok, batch, eos_id, handles, counts, rec["tokens"], bar)
    finally:
        for h in handles.values():
            h.close()
    splits = {}
    for s in SPLITS:
        final = out / f"{s}.bin"
        os.replace(tmp_files[s], final)
        splits[s] = {"file": final.name, "tokens": counts[s], "bytes": final.stat().st_size,
                     "sha256": file_sha256(final), "documents": sum(r["documents"][s] for r in records),
                     "text_bytes": sum(r["text_bytes"][s] for r in records)}
    manifest = {
        "request": request,
        "dtype": "uint16",
        "tokenizer": {"vocab_size": vocab, "eos_token": eos_name, "eos_id": eos_id},
        "sources": records,
        "splits": splits,
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")
    return out


def _encode_into(tok, batch, eos_id, handles, counts, source_counts, bar) -> None:
    encs = tok.encode_batch([d["text"] for d in batch], add_special_tokens=False)
    for doc, enc in zip(batch, encs):
        ids = np.asarray(enc.ids + [eos_id], dtype=np.uint32)
        handles[doc["split"]].write(ids.astype(np.uint16).tobytes())
        counts[doc["split"]] += len(ids)
        source_counts[doc["split"]] += len(ids)
        bar.update(len(doc["text"].encode()))

"""The real-text corpus pipeline on a small slice of the real Debian documentation packages.

The first run on a fresh machine downloads three .deb files (~23 MB) and converts the tokenizer; later runs reuse
both from ``data/``. Everything here reads that one session-scoped slice, so the module runs in seconds."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from thrifty.data import TokenDataset, clean_file, keep_paragraph, load_corpus_text, prepare_corpus
from thrifty.data.clean import clean_html, clean_markdown, clean_pod, clean_rst
from thrifty.data.prepare import split_of

SOURCES = ("python3.11-doc", "perl-doc", "postgresql-doc-15")


@pytest.fixture(scope="session")
def tokenizer():
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("needs apt-get and dpkg-deb (Debian) to fetch the corpus packages")
    from thrifty.pretrained import load_tokenizer

    try:
        return load_tokenizer()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, tokenizer) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    return prepare_corpus(out, sources=SOURCES, tokenizer=tokenizer, max_mb=3, progress=False)


@pytest.fixture(scope="session")
def manifest(corpus) -> dict:
    return json.loads((corpus / "manifest.json").read_text())


def test_manifest_records_sources_licences_and_counts(manifest):
    assert [s["package"] for s in manifest["sources"]] == list(SOURCES)
    for s in manifest["sources"]:
        assert s["version"] and s["license"] and "unknown" not in s["license"]
        assert sum(s["text_bytes"].values()) > 500_000
        assert s["tokens"]["train"] > 100_000
    licences = {s["package"]: s["license"] for s in manifest["sources"]}
    assert licences["postgresql-doc-15"] == "PostgreSQL"
    assert licences["perl-doc"] == "GPL-1+ or Artistic"
    assert manifest["tokenizer"]["vocab_size"] == 49152
    assert manifest["dtype"] == "uint16"
    splits = manifest["splits"]
    assert splits["validation"]["tokens"] > 0
    assert splits["validation"]["tokens"] < 0.2 * splits["train"]["tokens"]
    for s in manifest["sources"]:
        assert s["tokens"]["train"] + s["tokens"]["validation"] > 0


def test_cleaned_text_is_prose_without_markup(corpus):
    docs = load_corpus_text(corpus)
    assert len(docs) > 50
    text = "\n\n".join(docs)
    for leftover in (".. code-block::", ".. note::", "<div", "</p>", "=head1", "=item", "B<", "C<", "```", "¶",
                     "&nbsp;", "&lt;"):
        assert leftover not in text, leftover
    assert not any(line.rstrip().endswith("::") for line in text.splitlines())
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    assert letters / len(text) > 0.85
    pars = text.split("\n\n")
    assert all(len(p.split()) >= 8 for p in pars)
    # Exact duplicates (page boilerplate) are dropped within a source.
    assert len(set(pars)) > 0.99 * len(pars)


def test_cleaners_keep_prose_and_drop_code_tables_markup():
    prose = "The quick brown fox jumps over the lazy dog, and this sentence is plain English prose for the test."
    rst = f"""Title
=====

.. code-block:: python

   def f(x):
       return x  # {prose}

{prose} Use :func:`len` and ``len()`` here::

    print("literal block, {prose}")

+-------+-------+
| a     | b     |
+-------+-------+

.. note::

   {prose}

- {prose}
"""
    pars = [p for p in clean_rst(rst) if keep_paragraph(p)]
    assert len(pars) == 2
    assert pars[0].startswith(prose) and "Use len and len() here:" in pars[0]
    assert pars[1] == prose
    md = f"# Heading\n\n{prose}\n\n```python\nprint('{prose}')\n```\n\n    indented code, {prose}\n\n| a | b |\n|---|---|\n\n* [A link]({prose}) and **bold** {prose}\n"
    pars = [p for p in clean_markdown(md) if keep_paragraph(p)]
    assert pars == [prose, f"A link and bold {prose}"]
    pod = f"=head1 NAME\n\n{prose} B<bold> and C<< $a <=> $b >> and L<perlfunc/open> E<gt> x.\n\n    my $code = 1; # {prose}\n\n=cut\n"
    assert clean_pod(pod) == [f"{prose} bold and $a <=> $b and open > x."]
    page = (f"<html><head><title>{prose}</title></head><body><div class='sphinxsidebar'><p>{prose} nav</p></div>"
            f"<p>{prose} <code>x</code>&amp; more.</p><pre>{prose}</pre><table><tr><td>{prose}</td></tr></table>"
            "<ul><li>short item</li></ul></body></html>")
    assert [p for p in clean_html(page) if keep_paragraph(p)] == [f"{prose} x& more."]
    assert not keep_paragraph("struct foo_bar *baz = qux_alloc(GFP_KERNEL, 0x10, NULL); /* x */ ret = -EINVAL;")
    assert not keep_paragraph("Questo è un paragrafo in italiano che non dovrebbe restare nel corpus inglese.")


def test_split_is_deterministic(corpus, manifest, tokenizer, tmp_path):
    # pinned: the split comes from SHA-256 of the id, the same on every machine and in every run
    assert split_of("perl-doc/usr/share/perl/5.36.0/pod/perlfunc.pod") == "train"
    assert [i for i in range(200) if split_of(f"doc{i}") == "validation"] == [38]
    fractions = [split_of(f"doc{i}") == "validation" for i in range(20000)]
    assert 0.02 < np.mean(fractions) < 0.04
    again = prepare_corpus(tmp_path / "again", sources=SOURCES, tokenizer=tokenizer, max_mb=3, progress=False)
    m2 = json.loads((again / "manifest.json").read_text())
    assert m2["splits"] == manifest["splits"]


def test_prepare_is_idempotent(corpus, tokenizer):
    before = {p.name: p.stat().st_mtime_ns for p in corpus.glob("*.bin")}
    assert prepare_corpus(corpus, sources=SOURCES, tokenizer=tokenizer, max_mb=3, progress=False) == corpus
    assert {p.name: p.stat().st_mtime_ns for p in corpus.glob("*.bin")} == before


def test_tokens_decode_back_to_the_text(corpus, manifest, tokenizer):
    ds = TokenDataset(corpus, "train")
    eos = manifest["tokenizer"]["eos_id"]
    ends = np.flatnonzero(np.asarray(ds.tokens[:2_000_000]) == eos)
    first_docs = [d for d in load_corpus_text(corpus, split="train", max_documents=3)]
    start = 0
    for end, doc in zip(ends[:3], first_docs):
        assert tokenizer.decode(ds.tokens[start:end].tolist(), skip_special_tokens=False) == doc
        start = end + 1


def test_batches_shift_and_are_reproducible(corpus):
    ds = TokenDataset(corpus, "train")
    x, y = ds.batch(4, 64, seed=0)
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < ds.vocab_size
    x2, _ = ds.batch(4, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    assert not torch.equal(x, ds.batch(4, 64, seed=1)[0])


def test_eval_batches_cover_the_split_in_order(corpus):
    ds = TokenDataset(corpus, "validation")
    seq = 128
    batches = list(ds.iter_eval_batches(8, seq))
    assert len(batches) == ds.num_eval_batches(8, seq)
    xs = torch.cat([b[0] for b in batches])
    ys = torch.cat([b[1] for b in batches])
    n = xs.numel()
    assert n == ((ds.num_tokens - 1) // seq) * seq
    flat = torch.from_numpy(np.asarray(ds.tokens[: n + 1]).astype(np.int64))
    assert torch.equal(xs.flatten(), flat[:-1]) and torch.equal(ys.flatten(), flat[1:])
    assert len(list(ds.iter_eval_batches(8, seq, max_batches=2))) == 2
    assert torch.equal(next(iter(ds.iter_eval_batches(8, seq)))[0], batches[0][0])


def test_corrupted_token_file_is_rejected(corpus, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(corpus, copy, ignore=shutil.ignore_patterns("text"))
    path = copy / "validation.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="validation.bin.*sha256"):
        TokenDataset(copy, "validation")
    TokenDataset(copy, "validation", verify_checksum=False)  # size still right: only the checksum catches it
    path.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="validation.bin.*bytes"):
        TokenDataset(copy, "validation", verify_checksum=False)
    path.unlink()
    with pytest.raises(ValueError, match="validation.bin.*missing"):
        TokenDataset(copy, "validation")


def test_bad_arguments_name_the_argument(corpus, tmp_path):
    ds = TokenDataset(corpus, "validation", verify_checksum=False)
    with pytest.raises(ValueError, match="split"):
        TokenDataset(corpus, "test")
    with pytest.raises(ValueError, match="path_or_dir"):
        TokenDataset(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="path_or_dir"):
        TokenDataset(3)
    with pytest.raises(ValueError, match="seq_len"):
        ds.batch(2, ds.num_tokens)
    with pytest.raises(ValueError, match="batch_size"):
        ds.batch(0, 16)
    with pytest.raises(TypeError, match="seq_len"):
        ds.batch(2, 16.0)
    with pytest.raises(ValueError, match="max_batches"):
        next(ds.iter_eval_batches(2, 16, max_batches=0))
    with pytest.raises(ValueError, match="sources"):
        prepare_corpus(tmp_path / "x", sources=("wikipedia",))
    with pytest.raises(ValueError, match="corpus_dir"):
        prepare_corpus(tmp_path / "x", sources=(), corpus_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="max_mb"):
        prepare_corpus(tmp_path / "x", max_mb=0)
    with pytest.raises(TypeError, match="tokenizer"):
        prepare_corpus(tmp_path / "x", sources=SOURCES[:1], tokenizer="gpt2")
    with pytest.raises(ValueError, match="split"):
        load_corpus_text(corpus, split="dev")


def test_corpus_dir_of_text_files(corpus, tokenizer, tmp_path):
    """Any folder of .txt/.md/.rst/.html works as a source: here real pages and text from the slice."""
    src = tmp_path / "mine"
    src.mkdir()
    docs = load_corpus_text(corpus, source="perl-doc", max_documents=40)
    for i, doc in enumerate(docs):
        suffix = (".txt", ".md", ".rst")[i % 3]
        (src / f"doc{i}{suffix}").write_text(doc)
    (src / "page.html").write_text(f"<html><body><pre>code</pre><p>{docs[0].split(chr(10))[0]}</p></body></html>")
    (src / "ignored.bin").write_bytes(b"\x00\x01")
    out = prepare_corpus(tmp_path / "out", sources=(), corpus_dir=src, tokenizer=tokenizer, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in m["sources"]] == ["dir-mine"]
    # page.html only repeats a paragraph of doc0: dropped as a duplicate, so 40 documents and not 41.
    assert sum(m["sources"][0]["documents"].values()) == 40
    assert m["splits"]["train"]["tokens"] > 1000
    assert clean_file(src / "doc0.txt") == docs[0]

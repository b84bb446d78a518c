"""Real English text for training and perplexity: fetched from Debian documentation packages, cleaned to prose,
split deterministically and tokenized into flat ``uint16`` token files.

Why Debian packages: they are the only large, licensed, versioned English text that the project's machines and
CI can reach (no dataset hub). ``apt-get download`` fetches a ``.deb`` without installing anything system-wide
and ``dpkg-deb -x`` unpacks it into our own folder, so nothing outside ``data/`` changes.

Layout of a prepared corpus folder::

    manifest.json            what was built from what: sources, versions, licences, bytes, tokens, sha256
    train.bin validation.bin flat uint16 token ids, every document followed by the EOS id
    text/<source>.jsonl      the cleaned documents ({"id", "split", "text"} per line), for a look or re-tokenizing
    licenses/<package>.copyright  the package's own copyright file, kept next to the text derived from it
"""

from __future__ import annotations

import gzip
import hashlib
import html
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from .._checks import check_positive_int, check_range

FORMAT_VERSION = 1
# Bump when a cleaner changes: prepared corpora built with an older cleaner are then rebuilt.
CLEANER_VERSION = 4
SPLITS = ("train", "validation")
VALIDATION_FRACTION = 0.03  # ~3%: ~300K tokens of validation from ~50 MB of text
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".html", ".htm")

# ----------------------------------------------------------------------------------------------------------
# Cleaning: every cleaner turns one file into a list of prose paragraphs; ``keep_paragraph`` then drops what
# is not English prose (code, tables, identifiers, headings, other languages).
# ----------------------------------------------------------------------------------------------------------

_STOPWORDS = frozenset(
    "the a an of to and or in on at is are was were be been it its this that these those for with as by from "
    "not no can may must should will would if when then than which who what there their they you your we our "
    "has have had do does but so all any each some one also only such into more most other use used".split()
)
_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def keep_paragraph(par: str) -> bool:
    """True for a paragraph of English prose: at least 8 words, mostly letters, mostly plain words (not
    identifiers or numbers) and enough function words ("the", "of", "is", ...) that it reads as English."""
    words = par.split()
    if len(words) < 8:
        return False
    letters = sum(ch.isalpha() for ch in par)
    if (letters + len(words)) / len(par) < 0.8:  # mostly letters and spaces, not symbols or digits
        return False
    ascii_letters = sum(("a" <= ch <= "z") or ("A" <= ch <= "Z") for ch in par)
    if ascii_letters < 0.97 * letters:  # another script: a translation, not English
        return False
    plain = sum(1 for w in words if _WORD.fullmatch(w.strip(".,;:!?()\"'“”‘’")))
    if plain < 0.7 * len(words):  # identifiers, paths, option names dominate
        return False
    stop = sum(1 for w in words if w.lower().strip(".,;:!?()\"'“”‘’") in _STOPWORDS)
    return stop >= 0.15 * len(words)


def _normalize(par: str) -> str:
    return " ".join(par.split())


class _HTMLProse(html.parser.HTMLParser):
    """Collects the text of block elements (p, li, dd, div.para, ...) outside code, tables, navigation and
    page furniture; every block boundary ends a paragraph."""

    SKIP_TAGS = {"head", "script", "style", "pre", "table", "nav", "footer", "header", "math", "svg", "dt",
                 "h1", "h2", "h3", "h4", "h5", "h6", "title", "form", "button", "select", "textarea", "caption"}
    SKIP_CLASSES = ("sphinxsidebar", "related", "footer", "highlight", "docnav", "menu", "toc", "titlepage",
                    "navheader", "navfooter", "breadcrumb", "headerlink", "synopsis", "rellink", "sig",
                    "searchbox", "copyright", "admonition-title", "fancy_title", "tagline", "literal-block",
                    "header", "nav-panel", "example", "programlisting")
    BLOCK_TAGS = {"p", "div", "li", "ul", "ol", "dl", "dd", "blockquote", "section", "article", "br", "hr",
                  "tr", "td", "th", "body", "main", "figure", "figcaption", "aside"}
    VOID_TAGS = {"br", "hr", "img", "meta", "link", "input", "wbr", "col", "area", "base", "source"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.skip_depth = {}  # tag -> open count, for SKIP_TAGS
        self.class_skips: list[tuple[str, bool]] = []  # (tag, skipping) for elements that may carry a class
        self.buf: list[str] = []
        self.paragraphs: list[str] = []

    def _skipping(self) -> bool:
        return any(self.skip_depth.values()) or any(s for _, s in self.class_skips)

    def handle_starttag(self, tag, attrs):
        if tag in self.BLOCK_TAGS or tag in self.SKIP_TAGS:
            self._flush()
        if tag in self.VOID_TAGS:
            return
        if tag in self.SKIP_TAGS:
            self.skip_depth[tag] = self.skip_depth.get(tag, 0) + 1
        if tag in ("div", "span", "section", "aside", "p", "ul", "ol", "dl", "a"):
            cls = next((v or "" for k, v in attrs if k == "class"), "")
            role = next((v or "" for k, v in attrs if k == "role"), "")
            skip = role == "navigation" or any(c in cls for c in self.SKIP_CLASSES)
            if tag == "p" and "title" in cls.split():  # DocBook figure/table titles
                skip = True
            self.class_skips.append((tag, skip))

    def handle_endtag(self, tag):
        if tag in self.BLOCK_TAGS or tag in self.SKIP_TAGS:
            self._flush()
        if tag in self.SKIP_TAGS and self.skip_depth.get(tag):
            self.skip_depth[tag] -= 1
        if tag in ("div", "span", "section", "aside", "p", "ul", "ol", "dl", "a"):
            # Pop up to the matching open tag (HTML allows unclosed <p>, so the stack can hold extra entries).
            for i in range(len(self.class_skips) - 1, -1, -1):
                if self.class_skips[i][0] == tag:
                    del self.class_skips[i:]
                    break

    def handle_data(self, data):
        if not self._skipping():
            self.buf.append(data)

    def _flush(self):
        if self.buf:
            par = _normalize("".join(self.buf))
            self.buf = []
            if par:
                self.paragraphs.append(par)

    def close(self):
        super().close()
        self._flush()


def clean_html(text: str) -> list[str]:
    """Prose paragraphs of an HTML page (Sphinx, DocBook or hand-written)."""
    parser = _HTMLProse()
    parser.feed(text)
    parser.close()
    # Sphinx appends a pilcrow to permalinks; "¶" is never prose.
    return [p.replace("¶", "").strip() for p in parser.paragraphs]


_RST_ROLE = re.compile(r":[\w:+.-]+:`([^`]*)`")
_RST_LINK = re.compile(r"`([^`<]*?)\s*<[^>`]*>`__?")
_RST_LITERAL = re.compile(r"``(.+?)``")
_RST_INTERP = re.compile(r"`([^`]+)`_{0,2}")
_RST_EMPH = re.compile(r"\*{1,2}([^*\s][^*]*?)\*{1,2}")
_RST_REF = re.compile(r"\b(\w+)__?\b")
_RST_SUBST = re.compile(r"\|[^|\s][^|]*\|_{0,2}")
_RST_ADORN = re.compile(r"^\s*([=\-`:'\"~^_*+#<>.])\1{2,}\s*$")
_RST_TABLE = re.compile(r"^\s*(\+[-=+]+\+|\|.*\||=+(\s+=+)+)\s*$")
_BULLET = re.compile(r"^\s*(?:[-*+•]|#\.|\(?\d+[.)]|\(?[a-zA-Z][.)])\s+")


def _rst_inline(par: str) -> str:
    par = _RST_ROLE.sub(lambda m: re.sub(r"\s*<[^>]*>$", "", m.group(1)).lstrip("~!"), par)
    par = _RST_LINK.sub(r"\1", par)
    par = _RST_LITERAL.sub(r"\1", par)
    par = _RST_INTERP.sub(r"\1", par)
    par = _RST_EMPH.sub(r"\1", par)
    par = _RST_SUBST.sub("", par)
    par = _RST_REF.sub(r"\1", par)
    return par


def _blocks(lines: list[str]) -> Iterator[list[str]]:
    """Groups lines into blank-line separated blocks."""
    block: list[str] = []
    for line in lines:
        if line.strip():
            block.append(line)
        elif block:
            yield block
            block = []
    if block:
        yield block


def _bullet_items(block: list[str]) -> list[list[str]]:
    """A block may hold several bullet items: each becomes its own paragraph (bullet marker removed)."""
    items: list[list[str]] = []
    for b in block:
        if _BULLET.match(b) or not items:
            items.append([_BULLET.sub("", b)])
        else:
            items[-1].append(b)
    return items


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def clean_rst(text: str) -> list[str]:
    """Prose paragraphs of reStructuredText: directives (code-block, toctree, tables, ...) and their bodies,
    literal blocks after ``::``, comments, tables, field lists and section adornments are dropped."""
    lines = text.expandtabs(8).splitlines()
    out: list[str] = []
    skip_indent: Optional[int] = None  # skipping lines indented deeper than this (a directive or literal body)
    keep: list[str] = []
    for line in lines:
        if skip_indent is not None:
            if not line.strip() or _indent(line) > skip_indent:
                keep.append("")  # a skipped body still separates the blocks around it
                continue
            skip_indent = None
        stripped = line.strip()
        if stripped.startswith(".."):  # directive, comment, target, footnote: skip it and its body
            skip_indent = _indent(line)
            keep.append("")
            continue
        keep.append(line)
        if stripped.endswith("::"):  # a literal block follows, indented deeper than this paragraph
            skip_indent = _indent(line)
            keep[-1] = line.rstrip()[:-2].rstrip() + (":" if stripped != "::" else "")
    for block in _blocks(keep):
        if any(_RST_TABLE.match(b) for b in block):
            continue
        block = [b for b in block if not _RST_ADORN.match(b)]
        if not block or block[0].lstrip().startswith(":"):  # field list
            continue
        items = _bullet_items(block)
        out.extend(_normalize(_rst_inline(" ".join(i))) for i in items)
    return out


_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_MD_CODE = re.compile(r"`([^`]*)`")
_MD_EMPH = re.compile(r"(\*{1,3}|_{1,3})(\S(?:.*?\S)?)\1")
_TAG = re.compile(r"<[^>]+>")


def clean_markdown(text: str) -> list[str]:
    """Prose paragraphs of Markdown: fenced and indented code, tables, headings and HTML tags are dropped."""
    keep: list[str] = []
    fence: Optional[str] = None
    prev_blank = True
    for line in text.expandtabs(4).splitlines():
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            keep.append("")
            continue
        if stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            keep.append("")
            continue
        code = prev_blank and _indent(line) >= 4 and not _BULLET.match(line)
        if code or stripped.startswith(("#", "|", ">")) and stripped.startswith(("#", "|")) or re.fullmatch(r"[-=*_ ]{3,}", stripped or "x"):
            keep.append("")
            prev_blank = True
            continue
        keep.append(line.lstrip("> ") if stripped.startswith(">") else line)
        prev_blank = not stripped
    out = []
    for block in _blocks(keep):
        items = _bullet_items(block)
        for i in items:
            par = " ".join(i)
            par = _MD_LINK.sub(r"\1", par)
            par = _MD_CODE.sub(r"\1", par)
            par = _MD_EMPH.sub(r"\2", par)
            par = html.unescape(_TAG.sub("", par))
            out.append(_normalize(par))
    return out


# C<< $a <=> $b >>: n brackets open, n close, with whitespace inside.
_POD_MULTI = [re.compile(rf"([A-Z])<{{{n}}}\s+(.*?)\s+>{{{n}}}", re.S) for n in (4, 3, 2)]
_POD_SINGLE = re.compile(r"([A-Z])<([^<>]*)>")  # innermost B<x>, L<text|target>, E<gt>


def _pod_code(letter: str, body: str) -> str:
    if letter == "E":
        return {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}.get(body, html.unescape(f"&{body};"))
    if letter in "ZX":  # zero-width mark / index entry
        return ""
    if letter == "L":
        return body.split("|", 1)[0] if "|" in body else body.split("/", 1)[-1].strip('"')
    return body


def _pod_inline(par: str) -> str:
    for pattern in _POD_MULTI:
        par = pattern.sub(lambda m: _pod_code(m.group(1), m.group(2)), par)
    for _ in range(4):  # nested codes, innermost first
        new = _POD_SINGLE.sub(lambda m: _pod_code(m.group(1), m.group(2)), par)
        if new == par:
            break
        par = new
    # Malformed leftovers such as C<print <<EOF;>: keep the body, drop the code letter and brackets.
    return re.sub(r"\b[BCFILS]<(.+?)>", r"\1", par)


def clean_pod(text: str) -> list[str]:
    """Prose paragraphs of Perl POD: commands, verbatim (indented) blocks and =begin/=for regions dropped."""
    out: list[str] = []
    in_region = False
    for block in text.split("\n\n"):
        block = block.strip("\n")
        if not block.strip():
            continue
        if block.startswith("=begin"):
            in_region = True
            continue
        if block.startswith("=end"):
            in_region = False
            continue
        if in_region or block.startswith("=") or block[0] in " \t":
            continue
        par = _normalize(_pod_inline(block))
        if not re.search(r"\b[A-Z]<", par):  # formatting codes we could not undo: not clean prose
            out.append(par)
    return out


def clean_plain(text: str) -> list[str]:
    """Prose paragraphs of plain text: blank-line separated blocks; indented or table-like ones dropped."""
    out = []
    for block in _blocks(text.expandtabs(8).splitlines()):
        if any(_RST_TABLE.match(b) or _RST_ADORN.match(b) for b in block):
            continue
        if min(_indent(b) for b in block) >= 4:  # code or a diagram, in plain-text documentation
            continue
        out.append(_normalize(" ".join(block)))
    return out


def clean_file(path: Path, kind: Optional[str] = None) -> str:
    """The cleaned text of one file: kept paragraphs joined by blank lines ("" if none survive)."""
    path = Path(path)
    raw = path.read_bytes()
    name = path.name
    if name.endswith(".gz"):
        raw = gzip.decompress(raw)
        name = name[:-3]
    text = raw.decode("utf-8", errors="replace")
    if kind is None:
        suffix = Path(name).suffix.lower()
        kind = {".html": "html", ".htm": "html", ".rst": "rst", ".md": "markdown", ".pod": "pod"}.get(suffix, "plain")
    cleaner = _CLEANERS[kind]
    return "\n\n".join(p for p in cleaner(text) if keep_paragraph(p))


_CLEANERS: dict[str, Callable[[str], list[str]]] = {
    "html": clean_html, "rst": clean_rst, "markdown": clean_markdown, "pod": clean_pod, "plain": clean_plain,
}

# ----------------------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DebianSource:
    """A Debian package and which of its files hold prose (globs relative to the unpacked tree)."""

    package: str
    globs: tuple[str, ...]
    exclude: str = ""  # regex searched in "/<relative path>": files to skip (translations, indexes, changelogs)
    license: str = ""  # used only when the copyright file has no machine-readable "Files: *" stanza


# The HTML of each package rather than its reST/DocBook sources: the rendered pages include the text that the
# build pulls in (kernel-doc comments, included files) and the markup is easier to drop reliably.
_SPHINX_PAGES = r"/_sources/|/_static/|/_images/|/genindex|/search\.html|/py-modindex|/np-modindex"
DEBIAN_SOURCES: tuple[DebianSource, ...] = (
    DebianSource("linux-doc-6.1", ("usr/share/doc/linux-doc-6.1/html/**/*.html",), r"/translations/|" + _SPHINX_PAGES),
    DebianSource("python3.11-doc", ("usr/share/doc/python3.11/html/**/*.html",), _SPHINX_PAGES, "PSF-2.0"),
    DebianSource("perl-doc", ("usr/share/perl/*/pod/*.pod",), r"/perltoc\.pod$"),
    DebianSource("postgresql-doc-15", ("usr/share/doc/postgresql-doc-15/html/*.html",), r"/bookindex"),
    DebianSource("python-django-doc", ("usr/share/doc/python-django-doc/html/**/*.html",), _SPHINX_PAGES),
    DebianSource("sqlite3-doc", ("usr/share/doc/sqlite3/**/*.html",), r"/changes\.html|/releaselog/"),
    DebianSource("debian-handbook", ("usr/share/doc/debian-handbook/html/en-US/*.html",), r"/ix01"),
    DebianSource("python-scipy-doc", ("usr/share/doc/python-scipy-doc/html/**/*.html",), _SPHINX_PAGES),
    # English pages only (translations are named page.<lang>.html); the big-page copies repeat the split pages.
    DebianSource("lilypond-doc-html", ("usr/share/doc/lilypond/html/Documentation/**/*.html",),
                 r"\.[a-z]{2}\.html$|-big-page\.html$"),
    DebianSource("git-doc", ("usr/share/doc/git-doc/**/*.html",), r"/RelNotes/"),
    DebianSource("maxima-doc", ("usr/share/doc/maxima-doc/html/*.html",), r"_toc\.html$|_abt\.html$", "GPL-2"),
    DebianSource("octave-doc", ("usr/share/doc/octave/**/*.html",), r"/index\.html$"),
    DebianSource("bash-doc", ("usr/share/doc/bash-doc/*.html",), ""),
    DebianSource("gnu-standards", ("usr/share/doc/gnu-standards/*.html",), "", "GFDL-1.3+ (no invariant sections)"),
    DebianSource("debian-reference-en", ("usr/share/debian-reference/*.en.html",), ""),
)
DEBIAN_PACKAGES = tuple(s.package for s in DEBIAN_SOURCES)


def debian_cache_dir() -> Path:
    """Where downloaded ``.deb`` files and their unpacked trees are kept (shared by every corpus build)."""
    from ..paths import data_dir

    return data_dir() / "debian"


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def fetch_debian_package(package: str, cache_dir: Optional[Path] = None) -> Path:
    """The ``.deb`` of ``package`` in ``cache_dir``, downloaded with ``apt-get download`` if not there yet.

    Runs ``apt-get update`` once when apt does not know the package (a fresh machine has no package lists)."""
    cache = Path(cache_dir) if cache_dir is not None else debian_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"apt-get not found: cannot fetch Debian package {package!r}; pass corpus_dir= instead")
    # Sandbox=root: as root apt would otherwise try to download as user _apt, which cannot write to our cache.
    cmd = ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package]
    res = _run(cmd, cache)
    if res.returncode != 0:
        upd = _run(["apt-get", "update", "-q"], cache)
        res = _run(cmd, cache)
        if res.returncode != 0:
            raise RuntimeError(
                f"apt-get download {package} failed (after apt-get update, rc={upd.returncode}): "
                f"{(res.stderr or res.stdout).strip()[-500:]}"
            )
    found = sorted(cache.glob(f"{package}_*.deb"))
    if not found:
        raise RuntimeError(f"apt-get download {package} reported success but left no .deb in {cache}")
    return found[-1]


def unpack_deb(deb: Path, dest_root: Optional[Path] = None) -> tuple[Path, str]:
    """Unpacks ``deb`` (``dpkg-deb -x``) once into ``<dest_root>/<package>_<version>``; returns (dir, version)."""
    deb = Path(deb)
    info = _run(["dpkg-deb", "-f", str(deb), "Package", "Version"], deb.parent)
    if info.returncode != 0:
        raise ValueError(f"{deb}: not a readable .deb ({info.stderr.strip()})")
    fields = dict(line.split(": ", 1) for line in info.stdout.strip().splitlines())
    root = Path(dest_root) if dest_root is not None else deb.parent / "unpacked"
    dest = root / f"{fields['Package']}_{fields['Version']}"
    done = dest / ".unpacked"
    if not done.is_file():
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        res = _run(["dpkg-deb", "-x", str(deb), str(dest)], deb.parent)
        if res.returncode != 0:
            raise RuntimeError(f"dpkg-deb -x {deb} failed: {res.stderr.strip()}")
        done.write_text(fields["Version"])
    return dest, fields["Version"]


def read_license(tree: Path, package: str, fallback: str = "") -> tuple[str, list[str], str]:
    """(licence of the package's main files, every licence named, full copyright text), read from
    ``usr/share/doc/<pkg>/copyright`` in the unpacked tree.

    In Debian's machine-readable format the ``Files: *`` stanza names the licence of the bulk of the package;
    a free-form file (python3.11-doc) has none, and then ``fallback`` (read by hand from that file) is used."""
    path = tree / "usr" / "share" / "doc" / package / "copyright"
    if not path.is_file():
        return fallback or "unknown (no copyright file)", [], ""
    text = path.read_text(errors="replace")
    names = list(dict.fromkeys(m.group(1).strip() for m in re.finditer(r"^License:[ \t]*(\S.*)$", text, re.M)))
    main = None
    for stanza in re.split(r"\n\s*\n", text):
        if re.search(r"^Files:[ \t]*\*[ \t]*$", stanza, re.M):
            m = re.search(r"^License:[ \t]*(\S.*)$", stanza, re.M)
            main = m.group(1).strip() if m else None
            break
    return main or fallback or "see copyright file", names, text


# ----------------------------------------------------------------------------------------------------------
# Building a corpus
# ----------------------------------------------------------------------------------------------------------


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


def _as_tokenizer(tokenizer):
    """A ``tokenizers.Tokenizer`` from one, or from a transformers fast tokenizer; the SmolLM2 one by default."""
    if tokenizer is None:
        from ..pretrained import load_tokenizer

        return load_tokenizer()
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(
        f"tokenizer: expected a tokenizers.Tokenizer or a transformers fast tokenizer, got {type(tokenizer).__name__}"
    )


_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


def eos_token_of(tokenizer) -> tuple[str, int]:
    """The end-of-document token (name, id) that separates documents in the token files."""
    for tok in _EOS_CANDIDATES:
        tid = tokenizer.token_to_id(tok)
        if tid is not None:
            return tok, tid
    raise ValueError(f"tokenizer: has none of the end-of-text tokens {list(_EOS_CANDIDATES)}")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
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
    tok = _as_tokenizer(tokenizer)
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
        tree, version = unpack_deb(deb)
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


def load_corpus_text(path=None, split: Optional[str] = None, source: Optional[str] = None,
                     max_documents: Optional[int] = None) -> list[str]:
    """The cleaned documents of a prepared corpus (all sources unless ``source``; both splits unless ``split``),
    for a look at what the model is trained on."""
    from ..paths import data_dir

    out = Path(path) if path is not None else data_dir() / "corpus"
    if out.name == "manifest.json":
        out = out.parent
    manifest_path = out / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"path: no manifest.json in {out}; run thrifty.data.prepare_corpus() first")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split: expected one of {list(SPLITS)}, got {split!r}")
    if max_documents is not None:
        check_positive_int("max_documents", max_documents)
    manifest = json.loads(manifest_path.read_text())
    names = [r["name"] for r in manifest["sources"]]
    if source is not None and source not in names:
        raise ValueError(f"source: expected one of {names}, got {source!r}")
    docs: list[str] = []
    for name in names if source is None else [source]:
        with open(out / "text" / f"{name}.jsonl", encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)
                if split is None or doc["split"] == split:
                    docs.append(doc["text"])
                    if max_documents is not None and len(docs) >= max_documents:
                        return docs
    return docs

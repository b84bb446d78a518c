"""Cleaning: each cleaner turns one documentation file (HTML, reStructuredText, Markdown, Perl POD or plain
text) into a list of prose paragraphs; :func:`keep_paragraph` then drops what is not English prose (code, tables,
identifiers, headings, other languages). :func:`clean_file` picks the cleaner by the file's suffix."""

from __future__ import annotations

import gzip
import html
import html.parser
import re
from pathlib import Path
from typing import Callable, Iterator, Optional

# Bump when a cleaner changes: prepared corpora built with an older cleaner are then rebuilt.
CLEANER_VERSION = 4

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

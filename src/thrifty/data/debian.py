"""Debian documentation packages as a text source: which packages and which of their files hold prose, and
fetching them without installing anything system-wide.

Why Debian packages: they are the only large, licensed, versioned English text that the project's machines and
CI can reach (no dataset hub). ``apt-get download`` fetches a ``.deb`` into our own folder (``<data>/debian``)
and ``dpkg-deb -x`` unpacks it into a temporary folder there while it is cleaned, so nothing outside ``data/``
changes. Each package's copyright file names its licence (:func:`read_license`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional


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
    """Where downloaded ``.deb`` files are kept, shared by every corpus build (each is unpacked only while it is
    cleaned, :func:`unpacked_deb`)."""
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


def deb_version(deb: Path) -> str:
    """The Version field of ``deb`` (ValueError when it is not a readable .deb)."""
    info = _run(["dpkg-deb", "-f", str(deb), "Version"], Path(deb).parent)
    if info.returncode != 0 or not info.stdout.strip():
        raise ValueError(f"{deb}: not a readable .deb ({info.stderr.strip()})")
    return info.stdout.strip()


@contextmanager
def unpacked_deb(deb: Path) -> Iterator[tuple[Path, str]]:
    """Unpacks ``deb`` (``dpkg-deb -x``) into a temporary folder beside it; yields (folder, version) and removes
    the folder afterwards. The unpacked trees are 1-2x bigger than the .deb files and needed only while one
    package is cleaned, so keeping them all would fill a small disk (a CI runner ran out at the eighth)."""
    deb = Path(deb)
    version = deb_version(deb)
    with tempfile.TemporaryDirectory(prefix="unpack-", dir=deb.parent) as tmp:
        res = _run(["dpkg-deb", "-x", str(deb), tmp], deb.parent)
        if res.returncode != 0:
            raise RuntimeError(f"dpkg-deb -x {deb} failed: {res.stderr.strip()[-2000:]}")
        yield Path(tmp), version


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

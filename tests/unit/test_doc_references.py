"""Every cross-reference to a doc names a file that exists and a section that is there.

Code and docs cite sections as ``docs/training.md, "Features that fit the disk"`` (or ``[x.md](x.md), "..."``).
When a section moves to another file or is renamed, the citation goes stale silently; this test reads every
tracked text file, finds such citations (across line breaks and comment markers) and checks that the quoted
text is part of a heading or a bold lead-in (``**...**``) of the named doc, case-insensitive, backticks ignored.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = (".py", ".md", ".sh", ".toml", ".yaml", ".yml")
# a doc name (optionally as a markdown link), then a quoted section name
REFERENCE = re.compile(
    r"(?:docs/)?(?P<doc>[\w-]+\.md)\)?\]?(?:\([\w/.-]+\))?[,:]?\s+(?:section\s+)?"
    r"(?:\"(?P<s1>[^\"]{3,80})\"|'(?P<s2>[^']{3,80})'|“(?P<s3>[^”]{3,80})”)"
)
# a line break with the next line's indentation and comment marker: a citation may wrap
WRAP = re.compile(r"\s*\n\s*(?:#+\s+|//\s*)?")


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names = [n for n in out.splitlines() if n.endswith(SUFFIXES) or n.endswith("Makefile")]
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def _key(text: str) -> str:
    return " ".join(text.replace("`", "").lower().split())


def _anchors(doc: Path) -> list[str]:
    text = doc.read_text(encoding="utf-8")
    headings = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    lines = text.splitlines() + [""]
    leads = []  # bold text within a line, or a bold lead-in wrapped onto the next line
    for line, following in zip(lines, lines[1:], strict=False):
        leads += re.findall(r"\*\*([^*]+?)\*\*", line)
        if re.match(r"\s*(?:[*-]\s+)?\*\*[^*]+$", line):
            leads += re.findall(r"\*\*([^*]+?)\*\*", f"{line} {following}")
    return [_key(a) for a in headings + leads]


def _doc_path(name: str) -> Path | None:
    for candidate in (ROOT / "docs" / name, ROOT / name):
        if candidate.is_file():
            return candidate
    return None


def citation_problem(doc_name: str, section: str, anchors: dict[Path, list[str]]) -> str | None:
    """Why a citation of ``section`` in ``doc_name`` is stale, or None when it is not."""
    doc = _doc_path(doc_name)
    if doc is None:
        return f"no file {doc_name} in docs/ or the repository root"
    if not any(_key(section) in a for a in anchors.setdefault(doc, _anchors(doc))):
        return f"no heading or bold lead-in of {doc.relative_to(ROOT)} holds that text"
    return None


def stale_references() -> list[str]:
    anchors: dict[Path, list[str]] = {}
    stale: list[str] = []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        text = WRAP.sub(" ", path.read_text(encoding="utf-8", errors="replace"))
        for m in REFERENCE.finditer(text):
            problem = citation_problem(m["doc"], m["s1"] or m["s2"] or m["s3"], anchors)
            if problem is not None:
                stale.append(f"{path.relative_to(ROOT)}: {m.group(0)!r}: {problem}")
    return stale


def test_every_cited_doc_section_exists() -> None:
    stale = stale_references()
    assert not stale, "stale doc citations (rename the citation or the section):\n" + "\n".join(stale)


def test_the_checker_finds_a_stale_citation() -> None:
    """The pattern catches both citation forms, wrapped across a comment line; a section that is not in the
    doc, or a doc that does not exist, is reported; one that is, is not."""
    for text in (
        '# see docs/training.md, "Features that\n# fit the disk"',
        "(see [training.md](training.md), 'Features that fit the disk')",
    ):
        m = REFERENCE.search(WRAP.sub(" ", text))
        assert m is not None and _key(m["s1"] or m["s2"]) == "features that fit the disk", text
    anchors: dict[Path, list[str]] = {}
    assert citation_problem("training.md", "Features that fit the disk", anchors) is None
    assert "no heading" in (citation_problem("training.md", "A section nobody wrote", anchors) or "")
    assert "no file" in (citation_problem("no-such-doc.md", "Anything", anchors) or "")

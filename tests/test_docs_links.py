"""The repository's documentation points only inside the repository, at things that exist.

Every .py and .md file git knows (tracked, or new and not ignored) is read, and:

* none mentions the old out-of-tree design file: the theory lives in
  docs/theory.md, in the repository;
* every relative markdown link ``[text](path#anchor)`` in a .md file names a file or
  folder that exists (relative to the linking file), and an anchor into a .md file
  names one of its headings (GitHub's slugs);
* every backticked path under a top-level folder of the repository (torch_hca/,
  passes/, backends/, tests/, examples/, docs/), and every mention of a .md file
  under docs/, names a file or folder that exists (relative to the repository root;
  a ``::test`` or ``:function`` suffix is dropped).

Pure file reading: no torch, no ranks.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

OLD_DESIGN_FILE = "DESIGN" + ".md"  # spelled in two pieces so this file does not mention it
TOP_FOLDERS = ("torch_hca", "passes", "backends", "tests", "examples", "docs")

MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
BACKTICKED_PATH = re.compile(r"`((?:%s)/[^`\s]*)`" % "|".join(TOP_FOLDERS))
DOCS_MENTION = re.compile(r"(?<![\w./-])(docs/[\w./-]+?\.md)(?![\w-])")
GLOB = re.compile(r"[*?\[{<]")


def _files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the file list comes from git")
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    names = [n for n in out.split("\0") if n.endswith((".py", ".md"))]
    return [ROOT / n for n in sorted(set(names)) if (ROOT / n).is_file()]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _broken_links(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root)
    broken = []
    if path.suffix == ".md":
        for m in MARKDOWN_LINK.finditer(text):
            target = m.group(1)
            if "://" in target or target.startswith(("mailto:", "#")):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve()
            if not dest.exists():
                broken.append(f"{rel}:{_line(text, m.start())}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{rel}:{_line(text, m.start())}: link to {target}: no such heading")
    seen = set()
    for pattern in (BACKTICKED_PATH, DOCS_MENTION):
        for m in pattern.finditer(text):
            target = re.split(r"::|:", m.group(1))[0]
            where = (_line(text, m.start()), target)
            if GLOB.search(target) or where in seen:
                continue
            seen.add(where)
            if not (root / target).exists():
                broken.append(f"{rel}:{where[0]}: {m.group(1)}: no such file")
    return broken


def test_no_file_mentions_the_old_design_file():
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _files()
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if OLD_DESIGN_FILE in line
    ]
    assert not offenders, (
        f"these lines cite {OLD_DESIGN_FILE}, which is not in the repository; cite the matching "
        f"section of docs/theory.md instead: {offenders}"
    )


def test_relative_links_and_paths_exist():
    broken = [b for p in _files() for b in _broken_links(p)]
    assert not broken, "broken links or paths:\n" + "\n".join(broken)


def test_the_theory_page_exists_and_the_readme_points_to_it():
    theory = ROOT / "docs" / "theory.md"
    assert theory.is_file()
    assert "docs/theory.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_checker_sees_a_broken_link(tmp_path):
    # The checks themselves: a page with two good and three bad references.
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title here\n\nText.\n", encoding="utf-8")
    page = tmp_path / "docs" / "b.md"
    docs, core = "docs", "torch_hca"  # kept apart so this file itself links nothing missing
    page.write_text(
        f"[ok](a.md#title-here) [gone](missing.md) [bad anchor](a.md#nope)\n`{docs}/a.md` and `{core}/nothing.py:fn`\n",
        encoding="utf-8",
    )
    broken = _broken_links(page, root=tmp_path)
    assert [b.split(": ", 1)[1] for b in broken] == [
        "link to missing.md: no such file",
        "link to a.md#nope: no such heading",
        "torch_hca/nothing.py:fn: no such file",
    ]

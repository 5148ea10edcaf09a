"""The user-facing text holds no internal references (one process, no ranks, no imports).

README.md, BENCHMARKS.md, CHANGELOG.md, every page of docs/ and every docstring of the
``horovod_micro`` package (modules, classes, functions and methods, read with :mod:`ast` so
that nothing is imported) must not name a tracker issue, a work round or a numbered section
("issue 12", "round 4", "section 3", "§3": BENCHMARKS.md's sections are named, not
numbered), a work session ("in a later session"), a commit (``dedc21e``) or an "earlier
tree", nor an absolute path of one machine (``/work/...``, ``/tmp/...``) as where something
is. A user reads what a version does, not how it was made.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "horovod_micro"

#: Internal references. A command-line flag (``--rounds 8``) is not one, and a path counts
#: only where it starts (``/var/tmp/...`` is not one).
FORBIDDEN = re.compile(
    r"(?<![-\w])(?:issues?\s+#?\d|rounds?\s+\d|sections?\s+\d)"
    r"|§"
    r"|(?<![\w.~/$-])/(?:work|tmp)/"
    r"|\b(?:a|one|this|that|the|an?other|earlier|later|next|previous|last|same)\s+"
    r"(?:work\s+)?sessions?\b"
    r"|\b(?:earlier|later|previous|same|this)\s+tree\b"
    r"|(?<![\w#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])",
    re.IGNORECASE)


def _hits(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line of ``text`` with a forbidden reference."""
    return [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1)
            if FORBIDDEN.search(line)]


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "CHANGELOG.md",
            *sorted((REPO / "docs").glob("*.md"))]


def _docstrings(path: Path):
    """``(qualified name, first line of the docstring, docstring)`` of the module and of
    every class, function and method defined in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    if (doc := ast.get_docstring(tree, clean=False)) is not None:
        yield module, tree.body[0].lineno, doc

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}.{child.name}"
                if (doc := ast.get_docstring(child, clean=False)) is not None:
                    yield name, child.body[0].lineno, doc
                yield from walk(child, name)

    yield from walk(tree, module)


def test_the_pattern_catches_internal_references_only():
    for planted in ("see issue 12", "Issue 3's bar", "(issues 4 and 6)", "Round 4: again",
                    "this round 2", "BENCHMARKS.md, section 11", "sections 4 and 8", "§9",
                    "results in /work/shared/notes.md", "written to /tmp/run",
                    "`git clone REPO /tmp/fresh`", "measured in a later session",
                    "back to back in one session", "on dedc21e (device-side status)",
                    "alternated with c3c8357", "the same tree (ecdd1f3)", "an earlier tree"):
        assert FORBIDDEN.search(planted), planted
    for fine in ("interleaved round by round", "toward that round's partner",
                 "``round(t_p)``-th largest", "under /var/tmp/buildah-cache",
                 "--out-dir $PWD/runs/x", "BENCHMARKS.md, \"Selection cost\"",
                 "the issue of stale residuals", "~/tmp/x", "/workspace as working directory",
                 "`--rates 1gbit --rounds 8`", "6 rounds, medians",
                 "a watchdog in its own session", "1,425 KB", "seed 1234567",
                 "#abc1234 colour", "sha256 digest", "12.6M-weight MLP"):
        assert not FORBIDDEN.search(fine), fine


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_has_no_internal_references(path):
    hits = _hits(path.read_text(encoding="utf-8"))
    assert not hits, f"{path.relative_to(REPO)}:\n" + "\n".join(
        f"  line {number}: {line}" for number, line in hits)


def test_package_docstrings_have_no_internal_references():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10  # the walk saw the package
    found, seen = [], 0
    for path in files:
        for name, first_line, doc in _docstrings(path):
            seen += 1
            for offset, line in _hits(doc):
                found.append(f"  {path.relative_to(REPO)}:{first_line + offset - 1} "
                             f"({name}): {line}")
    assert seen > 100  # docstrings were read at all
    assert not found, "docstrings with internal references:\n" + "\n".join(found)

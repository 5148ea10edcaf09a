"""The documentation builds with warnings as errors, and its internal links resolve.

Builds docs/ with Sphinx (the venv's, ``sys.executable -m sphinx``, as ``make docs`` does)
into a temporary directory, then parses every HTML page with the standard library's
``html.parser``: every relative ``href``/``src`` must name a file of the build, and every
``#fragment`` an ``id`` (or ``<a name>``) in the page it points to. Sphinx and myst-parser
come with the ``test`` extra, which ``tools/setup.sh`` installs.
"""

from __future__ import annotations

import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


class _Page(HTMLParser):
    """The anchors a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[tuple[str, str]] = []  # (tag, target)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if attributes.get(key):
                self.ids.add(attributes[key])
        for key in ("href", "src"):
            if attributes.get(key) is not None:
                self.links.append((tag, attributes[key]))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


@pytest.fixture(scope="module")
def built_html(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "html"
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(out), "-d", str(out.parent / "doctrees")],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"sphinx-build failed (is the test extra installed? `make setup`):\n"
        f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}")
    return out


def test_every_page_is_built(built_html):
    pages = {p.stem for p in DOCS.glob("*.md")}
    built = {p.stem for p in built_html.glob("*.html")}
    assert pages <= built, f"pages not built: {sorted(pages - built)}"


def test_every_internal_link_and_anchor_resolves(built_html):
    pages = sorted(p for p in built_html.rglob("*.html") if "_static" not in p.parts)
    assert pages
    parsed = {p.resolve(): _parse(p) for p in pages}
    broken, checked = [], 0
    for page, content in parsed.items():
        for tag, target in content.links:
            split = urlsplit(target)
            if split.scheme or split.netloc or target.startswith("//"):
                continue  # external (http:, https:, mailto:, ...)
            if not split.path and not split.fragment:
                continue  # href="" or "?query": the page itself
            path = (page.parent / unquote(split.path)).resolve() if split.path else page
            where = f"{page.relative_to(built_html.resolve())}: <{tag}> {target}"
            checked += 1
            if not path.is_relative_to(built_html.resolve()) or not path.exists():
                broken.append(f"{where}: no file {path}")
                continue
            if path.is_dir():
                path = path / "index.html"
            if split.fragment and path.suffix == ".html":
                ids = parsed[path].ids if path in parsed else _parse(path).ids
                if unquote(split.fragment) not in ids:
                    broken.append(f"{where}: no id {split.fragment!r} in {path.name}")
    assert checked > 100  # the parser saw the pages' links at all
    assert not broken, "broken internal links:\n" + "\n".join(broken)


def test_cross_page_anchors_are_checked(built_html):
    # A link into another page's section must reach that section: the check above would
    # catch a missing heading anchor only if such links exist.
    links = [target for _, target in _parse(built_html / "index.html").links]
    assert any(".html#" in link for link in links)

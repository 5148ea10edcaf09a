"""Sphinx configuration: Markdown pages (myst-parser) and the API from docstrings.

Build with ``make docs``, which runs
``sphinx-build -W --keep-going -b html docs docs/_build/html`` (warnings are errors).
"""

import os
import sys
from pathlib import Path

from docutils import nodes
from sphinx import addnodes

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(REPO))

project = "horovod-micro"
author = "horovod-micro contributors"
copyright = "horovod-micro contributors"  # noqa: A001  (Sphinx's name for it)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
root_doc = "index"

# Markdown: GitHub-style anchors for links such as [text](usage.md#checkpoints-and-resuming).
myst_heading_anchors = 3

# API reference: signatures and docstrings as written, in source order.
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures read as written; types are in the docstrings
autodoc_preserve_defaults = True  # defaults as in the source (Compression.none), not their repr
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "horovod-micro"
html_theme_options = {
    "description": "MiCRO gradient sparsification for Horovod and PyTorch",
    "fixed_sidebar": True,
    "page_width": "1180px",  # room for the tables
}
html_show_sourcelink = False
html_static_path = ["_static"]
html_css_files = ["custom.css"]


def _repository_markdown_as_download(app, doctree):
    """A page links to Markdown files outside docs/ (``../BENCHMARKS.md``) with the same
    relative path that works when the page is read on a code host. Sphinx would take such
    a link for a missing page; turn it into a download link instead, so the built HTML
    carries a copy of the file whatever it holds (its contents are never parsed here)."""
    source = Path(app.env.doc2path(app.env.docname))
    for node in list(doctree.findall(addnodes.pending_xref)):
        if node.get("refdomain") != "doc" or node.get("reftype") != "myst":
            continue
        target = node.get("reftarget", "")
        if target in app.env.found_docs:
            continue
        path = Path(target + ".md")
        if not path.is_absolute():
            path = (DOCS / path).resolve()
        if DOCS in path.parents or not path.is_file():
            continue  # a page of the docs, or nothing: Sphinx reports it as usual
        link = addnodes.download_reference(
            refdoc=app.env.docname, reftarget=os.path.relpath(path, source.parent),
            refexplicit=True)
        link += nodes.literal(path.name, path.name) if not node.astext() else node.children
        node.replace_self(link)


def setup(app):
    # Before Sphinx's own doctree-read handlers, which collect the files to copy.
    app.connect("doctree-read", _repository_markdown_as_download, priority=100)

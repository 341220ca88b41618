"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build/html`` (see README.md).

The API reference is generated from the docstrings (autodoc + napoleon, Google style); the
guides are the Markdown files next to this one (myst-parser). The build must stay free of
warnings: ``test/test_docs.py`` builds with ``-W`` and ``nitpicky`` on, so a reference to a
name that does not exist fails it.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
# The reference documents the public classes; it must build without the C++ extension too.
os.environ.setdefault("TORCH_CTRL_IMPL", "python")

import torch_ctrl  # noqa: E402

project = "torch_ctrl"
author = "torch_ctrl developers"
copyright = "torch_ctrl developers"
release = version = torch_ctrl.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
myst_heading_anchors = 3


autodoc_typehints = "description"  # types and defaults next to each parameter
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_mock_imports: list[str] = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Every cross-reference must resolve, except to torch and the standard library (no network here,
# so no intersphinx): those are named but not linked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|datetime|typing|collections|contextlib|abc|argparse)(\..*)?"),
    (r"py:.*", r"(dist|timedelta|Store|TCPStore|PrefixStore|Iterator|Sequence|Callable|Mapping|Any|Union)(\..*)?"),
    (r"py:.*", r"(Data|Timeout|Names|StoreLike|NoReturn|Optional|T)"),
    (r"py:class", r"(bytes|str|int|float|bool|list|dict|tuple|object|None|BaseException|Exception)"),
]

html_theme = "alabaster"
html_title = f"torch_ctrl {release}"
html_static_path: list[str] = []

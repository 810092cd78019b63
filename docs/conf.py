"""Sphinx configuration of the documentation site: ``sphinx-build -W -b html docs docs/_build/html``.

Markdown pages through MyST; the API reference from the docstrings (autodoc, Google-style sections through
napoleon). Warnings are errors in CI (``-W``), so a broken link or reference fails it.
"""

project = "nmst-fast"
author = "nmst-fast contributors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "img"]
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]
html_theme = "furo"
html_title = "nmst-fast"
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
suppress_warnings = ["myst.header"]

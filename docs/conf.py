"""Sphinx configuration of the decodespec reviewer docs.

Build with ``decodespec docs --out DIR``: it stages this file, the hand-written pages of
``docs/`` and the pages generated from the spec registries into a build folder and runs Sphinx
with warnings as errors.  Running ``sphinx-build docs/ ...`` directly lacks the generated pages.
The ``decodespec.checks.docs.extension`` extension renders the generated pages' directives and the
``{rule}`` / ``{error}`` roles, and fails the build on undocumented or unknown ids.
"""

project = "decodespec"
author = "decodespec contributors"
copyright = "decodespec contributors"

extensions = ["myst_parser", "decodespec.checks.docs.extension"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "results", "examples"]

myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "decodespec"
html_theme_options = {
    "page_width": "1280px",
    "sidebar_width": "240px",
    "description": "Executable spec of single-request LLM inference (M3.10) and decoding policy (M3.8)",
    "fixed_sidebar": True,
    "show_relbars": True,
}
html_sidebars = {"**": ["about.html", "navigation.html", "searchbox.html"]}
html_show_sourcelink = False
html_copy_source = False
html_last_updated_fmt = None

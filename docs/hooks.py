"""MkDocs hook: render the Sphinx roles of the package's docstrings as plain code.

The docstrings quote names as ``:class:`rfmem_fast.Memory``` (Sphinx style); Markdown
renders that as ``:class:`` followed by the code span. This hook drops the role (and the
``~`` shortening prefix) from the generated HTML, so the API pages read cleanly without
editing the docstrings.
"""
from __future__ import annotations

import re

# ":class:<code>" anywhere; "class:<code>" right after a tag (griffe splits a Returns entry
# at its first colon, which leaves the role without its leading colon)
_ROLE = re.compile(r"(?:(?<=>)|:)(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|term|ref):(<code>)~?")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(r"\1", html)

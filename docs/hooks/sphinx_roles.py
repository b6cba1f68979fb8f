"""MkDocs hook: docstrings cite objects with Sphinx roles (:func:`~visionpe.grid.grid_coords`); render them as code.

``:role:`` before the code is dropped, and a leading ``~`` keeps only the last component, as Sphinx does.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:attr|class|data|exc|func|meth|mod|obj):<code>(~?)([^<]*)</code>")


def _code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(_code, html)

"""MkDocs hook: the user pages show no ``[Note: ...]`` pointers (they name comments in the source, which the site does
not carry; docs/design.md lists where each lives)."""

from __future__ import annotations

import re
from typing import Any

# "([Note: X] in file.py)" and "([Note: X])" go whole; "see [Note: X] in file.py" keeps the note's name.
_PARENTHESISED = re.compile(r"\s*\(\[Note: [^\]]+\](?: in <code>[\w./]+</code>| in [\w./]+)?\)")
_INLINE = re.compile(r"\[Note: ([^\]]+)\](?: in <code>[\w./]+</code>| in [\w./]+)?")


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri in ("design.md", "internals.md"):
        return html
    html = _PARENTHESISED.sub("", html)
    return _INLINE.sub(r"the design note “\1”", html)

"""Check the built site (``make docs`` writes it into site/): every list rendered as a list, no source-comment pointers
or reST markup on the user pages. Exits 1 and lists what it found.

    python scripts/check_site.py site
"""

from __future__ import annotations

import html
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

INTERNAL = ("design", "notes", "internals")  # contributor pages: they may name the notes
# A paragraph line that starts a list item (- item, * item, 1. item) means a list rendered as run-on text.
LIST_LINE = re.compile(r"\n\s*(?:[-*+]|\d+\.)\s+\S")


class _Paragraphs(HTMLParser):
    """The text of each <p> outside <pre> and <code>."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._depth = 0
        self._code = 0
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "p":
            self._depth += 1
            self._text = []
        elif tag in ("pre", "code"):
            self._code += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "p" and self._depth:
            self._depth -= 1
            self.found.append("".join(self._text))
        elif tag in ("pre", "code") and self._code:
            self._code -= 1

    def handle_data(self, data: str) -> None:
        if self._depth:
            self._text.append(data if not self._code else "code")


def problems(site: Path) -> list[str]:
    found: list[str] = []
    pages = sorted(site.rglob("index.html"))
    for page in pages:
        name = page.parent.relative_to(site).as_posix() or "home"
        text = page.read_text()
        parser = _Paragraphs()
        parser.feed(text)
        for paragraph in parser.found:
            if LIST_LINE.search(paragraph):
                first = html.unescape(paragraph.strip().splitlines()[0])[:70]
                found.append(f"{name}: a list rendered as text, in the paragraph starting {first!r}")
        if not name.startswith(INTERNAL):
            body = html.unescape(re.sub(r"<[^>]+>", "", text))
            for marker in ("[Note:", "Example::"):
                if marker in body:
                    found.append(f"{name}: shows {marker!r} ({body.count(marker)} times)")
    if not pages:
        found.append(f"{site}: no pages (run make docs first)")
    return found


def main() -> int:
    site = Path(sys.argv[1] if len(sys.argv) > 1 else "site")
    found = problems(site)
    for line in found:
        print(line)
    print(f"{len(list(site.rglob('index.html')))} pages checked, {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

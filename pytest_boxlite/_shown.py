"""One escape for every text this plugin prints that it did not write itself.

Box names and records from a home, image references, service names, a box's output, a
debugger's lines and an xdist worker's words can all come from someone else: a guest (root in
its box), another local user who can write a shared home, or a project's files. Printed raw,
an escape sequence in any of them can set the terminal's title or clipboard (OSC 52), move the
cursor over earlier lines, or hide text behind a bidi override.  :func:`shown` writes each such
character as Python's ``ascii()`` would (``\\x1b``, ``\\u202e``), so what is printed is what is
there.
"""

from __future__ import annotations

import re

__all__ = ["shown"]

#: Every character of Unicode's Cc, Cf, Cs, Zl and Zp categories but tab and newline (Unicode
#: 14, ``tests/unit/test_shown.py`` checks the list against the running Python's): C0 and C1
#: controls (CSI, OSC, ...), DEL, the invisible format characters (zero-width ones, bidi marks,
#: embeddings, overrides and isolates, the BOM, the tag characters that can hide text), the line
#: and paragraph separators, and lone surrogates (a file name's undecodable bytes).  A regular
#: expression rather than ``str.isprintable``: a box's output can be megabytes.
_UNSAFE = (
    r"\x00-\x08\x0b-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u180e"
    r"\u200b-\u200f\u2028-\u202e\u2060-\u206f\ud800-\udfff\ufeff\ufff9-\ufffb\U000110bd\U000110cd"
    r"\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f"
)
_TEXT = re.compile(f"[{_UNSAFE}]")
_LINE = re.compile(f"[{_UNSAFE}\\t\\n]")


def _escaped(match: re.Match[str]) -> str:
    return ascii(match.group())[1:-1]


def shown(text: object, *, line: bool = False, limit: int | None = None) -> str:
    """``text`` (``str()`` of it) with every character that could act on a terminal escaped.

    Newline and tab stay as they are unless ``line`` is true: a name, a reference or a title is
    one line, and a newline in it could forge a second line of output.  Carriage return is
    always escaped (it would let a line overwrite what was printed before it on that line).
    With ``limit``, the result is cut to that many characters, ``...`` included.
    """
    out = (_LINE if line else _TEXT).sub(_escaped, str(text))
    if limit is not None and len(out) > limit:
        out = out[: max(0, limit - 3)] + "..."
    return out

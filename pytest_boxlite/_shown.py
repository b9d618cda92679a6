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

#: C0 controls but tab and newline, DEL, C1 controls (8-bit CSI, OSC, ...), the line and
#: paragraph separators, the bidi marks, embeddings, overrides and isolates, the BOM, and lone
#: surrogates (a file name's undecodable bytes, which a terminal cannot be sent at all).
_UNSAFE = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff"
_TEXT = re.compile(f"[{_UNSAFE}]")
_LINE = re.compile(f"[{_UNSAFE}\\t\\n]")


def _escaped(match: re.Match[str]) -> str:
    return ascii(match.group())[1:-1]


def shown(text: object, *, line: bool = False) -> str:
    """``text`` (``str()`` of it) with every character that could act on a terminal escaped.

    Newline and tab stay as they are unless ``line`` is true: a name, a reference or a title is
    one line, and a newline in it could forge a second line of output.  Carriage return is
    always escaped (it would let a line overwrite what was printed before it on that line).
    """
    return (_LINE if line else _TEXT).sub(_escaped, str(text))

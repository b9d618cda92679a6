"""``_shown.shown``: the one escape for printed text that came from a box, a home or a user."""

from __future__ import annotations

import unicodedata

import pytest

from pytest_boxlite._shown import shown


def test_terminal_sequences_are_shown_escaped() -> None:
    osc52 = "\x1b]52;c;cm0gLXJmIH4=\x07"
    title = "\x1b]0;owned\x9c"
    assert shown(osc52 + title) == "\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b]0;owned\\x9c"
    # CR would let a line overwrite what was printed before it; C1 CSI is one byte in 8-bit mode.
    assert shown("ok\rFAILED\x9b2J") == "ok\\rFAILED\\x9b2J"


@pytest.mark.parametrize(
    "char", ["\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"]
)
def test_bidi_overrides_and_isolates_are_escaped(char: str) -> None:
    assert shown(f"a{char}b") == f"a{ascii(char)[1:-1]}b"


def test_newline_and_tab_stay_in_text_and_are_escaped_in_a_line() -> None:
    assert shown("a\n\tb") == "a\n\tb"
    assert shown("name\nFAKE LINE\t", line=True) == "name\\nFAKE LINE\\t"


def test_printable_text_is_unchanged_and_the_limit_cuts() -> None:
    text = "héllo wörld ✓ 日本 🙂 [x] {y} ~"
    assert shown(text) == text
    assert shown("abcdefghij", limit=6) == "abc..."
    assert shown("abc", limit=6) == "abc"
    assert shown(b"\x1b") == "b'\\x1b'"  # str() of a non-str first, then escaped


def test_every_control_format_and_separator_character_is_escaped() -> None:
    # The list in _shown is written out (a scan of all code points at import would cost ~0.2 s):
    # any character of these categories in the running Python's Unicode it misses fails here.
    missed = [
        f"U+{cp:04X}"
        for cp in range(0x110000)
        if unicodedata.category(chr(cp)) in {"Cc", "Cf", "Cs", "Zl", "Zp"}
        and chr(cp) not in "\t\n"
        and shown(chr(cp)) == chr(cp)
    ]
    assert not missed, f"shown() leaves these as they are: {missed[:20]}"

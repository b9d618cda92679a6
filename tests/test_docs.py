"""The user-facing text (README.md and docs/) is checked like code.

- Every Python block marked runnable (an HTML comment ``<!-- runnable ... -->`` on the line
  before its fence; ``docs/about.md`` describes the convention) runs as a real pytest sub-run
  in a fresh directory, in real boxes, and must end with the outcomes its comment states.
- The text names no issue number and no work session: users have neither.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType

import pytest
from subruns import QUIET

ROOT = Path(__file__).resolve().parent.parent
#: The user-facing text: the README and every page of the documentation site.
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", *(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
)

_MARK = re.compile(r"^<!--\s*runnable(?P<attrs>(?:\s+[a-z]+=\"[^\"]*\")*)\s*-->\s*$")
_ATTR = re.compile(r'([a-z]+)="([^"]*)"')
_FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w{}-]*)")
#: The outcome counts a runnable block states (pytest's summary words; warnings are not one).
OUTCOME_KEYS = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")
_OUTCOMES = re.compile(rf"^({'|'.join(OUTCOME_KEYS)})=(\d+)$")


@dataclasses.dataclass
class Block:
    """One runnable example: the files it writes, how to run it, what it must end with."""

    page: str
    line: int
    files: dict[str, str]
    args: list[str]
    outcomes: dict[str, int]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _fenced(lines: list[str], start: int) -> tuple[str, str, int]:
    """The language and body of the fenced block opening at ``lines[start]``, and the line after it."""
    m = _FENCE.match(lines[start])
    if m is None:
        raise ValueError(f"line {start + 1}: a runnable comment must be followed by a fenced code block")
    fence = m.group("fence")
    end = start + 1
    while end < len(lines) and not lines[end].startswith(fence):
        end += 1
    if end == len(lines):
        raise ValueError(f"line {start + 1}: the code block is not closed")
    return m.group("lang"), "\n".join(lines[start + 1 : end]) + "\n", end + 1


def parse_blocks(page: Path) -> list[Block]:
    """The runnable blocks of one page; a malformed mark raises ``ValueError`` naming its line."""
    rel = str(page.relative_to(ROOT))
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    pending: dict[str, str] = {}
    i = 0
    while i < len(lines):
        m = _MARK.match(lines[i])
        if m is None:
            if "runnable" in lines[i] and lines[i].lstrip().startswith("<!--"):
                raise ValueError(f"{rel}:{i + 1}: malformed runnable comment {lines[i]!r}")
            i += 1
            continue
        attrs = dict(_ATTR.findall(m.group("attrs")))
        unknown = set(attrs) - {"file", "args", "outcomes"}
        if unknown:
            raise ValueError(f"{rel}:{i + 1}: unknown runnable attribute(s) {sorted(unknown)}")
        lang, body, after = _fenced(lines, i + 1)
        if lang != "python":
            raise ValueError(f"{rel}:{i + 1}: only python blocks are runnable, got {lang!r}")
        if "file" in attrs:
            pending[attrs["file"]] = body
        else:
            outcomes: dict[str, int] = {}
            for word in attrs.get("outcomes", "").split():
                om = _OUTCOMES.match(word)
                if om is None:
                    raise ValueError(f"{rel}:{i + 1}: bad outcome {word!r} (e.g. passed=2)")
                outcomes[om.group(1)] = int(om.group(2))
            if not outcomes:
                raise ValueError(f'{rel}:{i + 1}: a runnable block states its outcomes, e.g. outcomes="passed=2"')
            name = f"test_doc_{re.sub(r'[^a-z0-9]+', '_', rel.lower())}_{i + 1}.py"
            files = {**pending, name: body}
            pending = {}
            blocks.append(Block(rel, i + 1, files, shlex.split(attrs.get("args", "")), outcomes))
        i = after
    if pending:
        raise ValueError(f"{rel}: file block(s) {sorted(pending)} belong to no runnable test block after them")
    return blocks


def _all_blocks() -> Iterator[Block]:
    for page in PAGES:
        yield from parse_blocks(page)


BLOCKS = list(_all_blocks())


def test_the_docs_hold_runnable_blocks() -> None:
    """The parametrized test below must not pass by finding nothing (a changed mark, a moved page)."""
    pages = {b.page for b in BLOCKS}
    assert "README.md" in pages and any(p.startswith("docs/") for p in pages), pages
    assert len(BLOCKS) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_runnable_block(block: Block, pytester: pytest.Pytester, home: Path) -> None:
    for name, body in block.files.items():
        pytester.path.joinpath(name).write_text(body)
    result = pytester.runpytest_subprocess(*QUIET, f"--boxlite-home={home}", *block.args, timeout=300)
    outcomes = {k: v for k, v in result.parseoutcomes().items() if k in OUTCOME_KEYS}
    assert outcomes == block.outcomes, f"{block.id}: expected {block.outcomes}\n" + "\n".join(result.outlines[-60:])


# -- the project's own history stays out of user-facing text -------------------------------------

#: An issue number, a pull request, a work session, or a review of this project's own work.
HISTORY = re.compile(
    r"\b(issues?|PRs?|pull requests?|tickets?)\s*#?\d+"
    r"|(?<![\w&])#\d{1,4}\b"
    r"|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)\s+session"
    r"|\bsession\s+\d+\b"
    r"|\bthis project's machines?\b|\bno machine here\b",
    re.IGNORECASE,
)


#: A date: when this project's own work happened is no user's business (the changelog's releases aside).
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def history_mentions(text: str, *, dates: bool = True) -> list[str]:
    """Each line of ``text`` that speaks of the project's own history (``dates``: a date too)."""
    return [
        f"{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if HISTORY.search(line) or (dates and DATE.search(line))
    ]


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("as issue 15 asked", True),
        ("see #27", True),
        ("measured in the fifth session's quiet spell", True),
        ("on this project's machines", True),
        ("no machine here boots a VM", True),
        ("Issues 12/13 merged", True),
        ("each pytest session holds a lock", False),
        ("the session id is in every box name", False),
        ("a session-scoped fixture", False),
        ("`--boxlite-scope=worker`: the whole session runs in one box", False),
        ("colour #fff and `&#8212;`", False),
        ("the next session on that host removes them", False),
        ("measured on 2026-11-29", True),
    ],
)
def test_history_pattern(line: str, found: bool) -> None:
    assert bool(history_mentions(line)) is found, line


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_facing_text_names_no_issue_or_session(page: Path) -> None:
    hits = history_mentions(page.read_text(), dates=page.name != "CHANGELOG.md")
    assert not hits, f"{page.relative_to(ROOT)} speaks of this project's own history:\n" + "\n".join(hits)


def test_readme_options_table_lists_every_option() -> None:
    """The README's table is written by hand (short meanings, links): it must still name every option."""
    from pytest_boxlite.settings import OPTIONS

    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `--boxlite")]
    listed = {line.split("`")[1]: line for line in rows}
    for opt in OPTIONS:
        assert opt.flag in listed, f"README's options table lacks {opt.flag}"
        assert f"`{opt.ini}`" in listed[opt.flag] and f"`{opt.env}`" in listed[opt.flag], listed[opt.flag]
    assert len(listed) == len(OPTIONS), sorted(set(listed) - {o.flag for o in OPTIONS})


def test_readme_marker_arguments_are_the_markers() -> None:
    from pytest_boxlite.markers import ALLOWED

    line = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("`@pytest.mark.boxlite("))
    named = re.findall(r"(\w+)=", line)
    assert named == list(ALLOWED), named


def test_changelog_names_the_project_version() -> None:
    """The newest release in CHANGELOG.md is the version pyproject.toml declares (the one place it lives)."""
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None, "pyproject.toml declares no static version"
    releases = re.findall(r"^## \[?(\d+\.\d+\.\d+)\]?", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert releases and releases[0] == declared.group(1), (declared.group(1), releases)


def test_readme_links_point_at_files_that_exist() -> None:
    """The README's relative links lead into docs/ (and to the changelog and licence): none may dangle."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


# -- the built site reads right: every page has a title, no table shows as text -------------------

#: What a table that reStructuredText or Markdown did not parse leaves in a page's text: a run of
#: ``====`` column rules, or a Markdown ``|---|`` separator row (smart quotes make ``---`` a dash).
_TABLE_AS_TEXT = re.compile(r"={4,}\s+={4,}|\|\s*:?(?:-{3,}|[\u2013\u2014]+):?\s*\||^\s*\+-{3,}\+", re.MULTILINE)


class _Page(HTMLParser):
    """The main article of a Sphinx page (furo: ``<article role="main">``): its h1s and its text,
    code excluded (a literal block may show a table's source on purpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # inside the article
        self.code = 0  # inside <pre> or <code>
        self.h1 = 0
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "article" and (self.depth or ("role", "main") in attrs):
            self.depth += 1
        if self.depth and tag == "h1":
            self.h1 += 1
        if self.depth and tag in ("pre", "code"):
            self.code += 1

    def handle_endtag(self, tag: str) -> None:
        if self.depth and tag in ("pre", "code"):
            self.code = max(0, self.code - 1)
        if self.depth and tag == "article":
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth and not self.code:
            self.text.append(data)


def page_problems(html_dir: Path, sources: Path) -> list[str]:
    """What is wrong with the built page of each source page under ``sources``: a page with no
    title (its first table or paragraph then stands in for one, and its sections become top-level
    entries of every page's sidebar), or a table rendered as text."""
    problems = []
    for src in sorted([*sources.rglob("*.md"), *sources.rglob("*.rst")]):
        rel = src.relative_to(sources)
        if rel.parts[0].startswith("_"):
            continue
        built = html_dir / rel.with_suffix(".html")
        if not built.exists():
            problems.append(f"{rel}: no page was built")
            continue
        page = _Page()
        page.feed(built.read_text())
        if page.h1 != 1:
            problems.append(f"{rel}: {page.h1} titles (h1) in the page, not 1: is the title underlined?")
        text = "".join(page.text)
        m = _TABLE_AS_TEXT.search(text)
        if m is not None:
            problems.append(f"{rel}: a table rendered as text: {text[max(0, m.start() - 40) : m.end() + 40]!r}")
    return problems


def _sphinx(src: Path, out: Path) -> None:
    for mod in ("sphinx", "myst_parser", "furo"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed: python -m pip install -e '.[docs]' builds the site")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-b", "html", "-d", str(out / ".doctrees"), str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_every_built_page_has_a_title_and_real_tables(tmp_path: Path) -> None:
    """The site as users read it (the HTML, not only ``sphinx -W``, which passed with the API page
    opening on ``Python API ==== ====``): one title per page, every table a table."""
    _sphinx(ROOT / "docs", tmp_path / "html")
    assert page_problems(tmp_path / "html", ROOT / "docs") == []
    # The options reference is a section per option (its flag the title, an anchor to link to), not
    # a five-column table whose default and meaning columns a browser hid behind a horizontal scroll.
    from pytest_boxlite.settings import OPTIONS

    options = (tmp_path / "html" / "reference" / "options.html").read_text()
    assert "<table" not in options
    for opt in OPTIONS:
        assert (
            f'<h2><code class="docutils literal notranslate"><span class="pre">{opt.flag}</span></code>' in options
        ), opt.flag
    # The environment page's links to each option's section resolve.
    environment = (tmp_path / "html" / "reference" / "environment.html").read_text()
    for anchor in re.findall(r'href="options\.html#([^"]+)"', environment):
        assert f'id="{anchor}"' in options, anchor


@pytest.mark.timeout(300)
def test_the_page_check_finds_a_missing_title_and_a_table_as_text(tmp_path: Path) -> None:
    """The check above is not vacuous: a page whose title has no underline before its table (the
    API page's old shape) and a Markdown table whose separator row is short are both found."""
    src = tmp_path / "src"
    (src / "reference").mkdir(parents=True)
    (src / "conf.py").write_text('extensions = ["myst_parser"]\nhtml_theme = "furo"\n')
    (src / "index.md").write_text("# Home\n\n```{toctree}\nreference/api\nreference/table\n```\n")
    (src / "reference" / "api.rst").write_text(
        "Python API\n====  ====\ncall  does\n====  ====\n``a``   b\n====  ====\n\nSome text.\n"
    )
    # A separator row with fewer cells than the header: Markdown makes it a paragraph.
    (src / "reference" / "table.md").write_text("# Table\n\n| a | b |\n|---|\n| 1 | 2 |\n")
    _sphinx(src, tmp_path / "html")
    problems = page_problems(tmp_path / "html", src)
    assert any(p.startswith("reference/api.rst: 0 titles") for p in problems), problems
    assert any(p.startswith("reference/table.md: a table rendered as text") for p in problems), problems
    assert not any(p.startswith("index.md") for p in problems), problems


# -- the reference pages' generated regions: committed (readable on GitHub) and never stale --------


def _reference_generator() -> ModuleType:
    """``docs/_ext/boxlite_reference.py``, which needs pytest-boxlite alone (Sphinx only in its ``setup``)."""
    spec = importlib.util.spec_from_file_location("boxlite_reference", ROOT / "docs" / "_ext" / "boxlite_reference.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_reference_regions_match_the_code() -> None:
    """The tables in docs/reference/*.md are what the code gives now: a changed option, marker
    argument, fixture, variable or sub-command needs ``python docs/_ext/boxlite_reference.py --write``."""
    gen = _reference_generator()
    assert gen.drift() == [], "\n".join(gen.drift())
    # No directive is left for GitHub to show as text: each page holds its region in Markdown.
    for page, _ in gen.REGIONS.values():
        text = (ROOT / "docs" / page).read_text()
        assert "```{boxlite-" not in text, page


def test_the_drift_check_finds_a_stale_table_and_a_missing_region(tmp_path: Path) -> None:
    """The check above is not vacuous: a committed row that differs from the code, and a page whose
    region was deleted, are each named with the command that fixes them; ``--write`` fixes the first."""
    gen = _reference_generator()
    docs = tmp_path / "docs"
    (docs / "reference").mkdir(parents=True)
    for page, _ in gen.REGIONS.values():
        (docs / page).write_text((ROOT / "docs" / page).read_text())
    assert gen.drift(docs) == []
    options = docs / "reference" / "options.md"
    text = options.read_text()
    assert "`PYTEST_BOXLITE_CPUS`" in text
    options.write_text(text.replace("`PYTEST_BOXLITE_CPUS`", "`PYTEST_BOXLITE_VCPUS`", 1))
    marker = docs / "reference" / "marker.md"
    marker.write_text(re.sub(r"<!-- BEGIN generated.*?<!-- END generated -->", "", marker.read_text(), flags=re.DOTALL))
    problems = gen.drift(docs)
    assert len(problems) == 2, problems
    assert problems[0].startswith("docs/reference/marker.md: 0 regions"), problems
    assert problems[1].startswith("docs/reference/options.md:") and "PYTEST_BOXLITE_VCPUS" in problems[1], problems
    assert all(p.endswith("python docs/_ext/boxlite_reference.py --write") for p in problems), problems
    marker.write_text((ROOT / "docs" / "reference" / "marker.md").read_text())
    assert gen.write(docs) == ["docs/reference/options.md"]
    assert gen.drift(docs) == []
    assert options.read_text() == (ROOT / "docs" / "reference" / "options.md").read_text()


# -- the pages read right on GitHub too: Markdown links, not MyST roles ---------------------------

#: A MyST role GitHub shows as raw text and Markdown can say as a link: {doc}`...`, {ref}`...`.
_DOC_ROLE = re.compile(r"\{(doc|ref)\}`")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (an example may show a role or a link on purpose)."""
    return re.sub(r"^(```+|~~~+).*?^\1\s*$", "", text, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_link_in_markdown_and_every_link_resolves(page: Path) -> None:
    """A link between pages is a Markdown link (MyST resolves it on the site, GitHub in the
    repository), and its file exists; roles stay only where Markdown has nothing (API objects)."""
    text = _prose(page.read_text())
    roles = [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if _DOC_ROLE.search(line)]
    assert not roles, f"{page.relative_to(ROOT)}: write [text](page.md) instead of:\n" + "\n".join(roles)
    dangling = []
    for m in _LINK.finditer(text):
        target = m.group("target").split("#", 1)[0]
        if not target or "://" in target or target.startswith("mailto:"):
            continue
        if not (page.parent / target).exists():
            dangling.append(m.group("target"))
    assert not dangling, f"{page.relative_to(ROOT)}: links to files that do not exist: {dangling}"

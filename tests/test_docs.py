"""The README and the pages under docs/: every relative link names a file that exists, every page
is reachable from the README, and the README keeps the two commands CI reads."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page):
    fence = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # code spans are not links
            if not re.match(r"[a-z]+:|#", target):
                yield number, target.split("#")[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_names_a_file_that_exists(page):
    broken = [f"{page.name}:{n}: {t}" for n, t in relative_links(page) if not (page.parent / t).exists()]
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t).resolve() for _, t in relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_readme_keeps_the_run_and_the_test_command_between_their_markers():
    readme = (ROOT / "README.md").read_text()
    for marker in ("run-command", "test-command"):
        block = re.search(rf"<!-- {marker} -->\n```\n(.+)\n```\n<!-- /{marker} -->", readme)
        assert block and block.group(1).startswith("python3 -m venv .venv"), marker

"""The README and the guides link to files and sections that exist (the README was split into docs/*.md), and the
command-line reference is what the commands' --help says."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "baselines" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings (outside code blocks)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"^#{1,6} (.+)$", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_section_that_exist(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such section")
    assert broken == [], f"broken links in {page.relative_to(ROOT)}"


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for guide in ("docs/run.md", "docs/join.md", "docs/security.md", "docs/library.md"):
        assert f"]({guide})" in readme, guide


def test_the_cli_reference_is_what_the_commands_help_says():
    """docs/cli.md is written from the roles' parsers (scripts/cli_reference.py): an option added, changed or removed
    without rewriting it fails here."""
    result = subprocess.run([sys.executable, "scripts/cli_reference.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:] + "\nrun: python scripts/cli_reference.py"

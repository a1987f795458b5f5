"""The README stays a page: the two commands first, at most MAX_LINES lines, and a way into every page of the manual.

What the README used to hold (the configuration table, the metrics, the manual's prose) lives in docs/, whose
generated references tests/unit/test_docs.py checks against the code.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250
COMMANDS_WITHIN = 15  # lines from the top


def test_readme_fits_on_a_page():
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_readme_starts_with_demo_and_test_commands():
    text = README.read_text()
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]
    top = [line.split("#")[0].strip() for line in text.splitlines()[:COMMANDS_WITHIN]]
    assert "make demo" in top and "make test" in top


def test_readme_links_to_every_page_of_the_manual():
    linked = {target.split("#", 1)[0] for target in re.findall(r"\]\((docs/[^)\s]+)\)", README.read_text())}
    pages = {path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").rglob("*.md")}
    assert pages - linked == set(), "pages the README does not link to"

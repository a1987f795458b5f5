"""The manual stays true and whole: its generated references match the code, every page is in the nav, and
every relative link of README.md and docs/ leads to a file that exists (mkdocs' strict build checks docs/
links and anchors itself; the README lies outside it)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

from grpo_fleet.cli.docs_reference import metric_docs, stale_pages
from grpo_fleet.config import config_reference
from grpo_fleet.observe.metrics import actor_metrics, learner_metrics

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A module the manual names: `learner/door/intake.py`, `door/intake.py` or `intake.py` (a path's tail is enough).
MODULE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")
EXAMPLES = {"my_rewards.py", "my_env.py"}  # the user's own files in the manual's examples


def _nav_pages(entries: list) -> set[str]:
    pages: set[str] = set()
    for entry in entries:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages.update(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def _mkdocs_config() -> dict:
    # mkdocs.yml names a Python function for the mermaid fence (a !!python/name tag): read it, do not run it.
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links in code blocks are not links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


def test_the_generated_references_say_what_the_code_does():
    assert stale_pages(DOCS) == [], "run `make reference` and commit docs/reference/"


def test_the_references_name_every_config_key_and_every_metric():
    config = (DOCS / "reference" / "configuration.md").read_text()
    assert all(f"| `{key}` |" in config for key, _, _ in config_reference())
    metrics = (DOCS / "reference" / "metrics.md").read_text()
    for registry in (learner_metrics().registry, actor_metrics().registry):
        for doc in metric_docs(registry):
            assert f"| `{doc.name}` |" in metrics, f"docs/reference/metrics.md does not list {doc.name}"


def test_every_module_the_manual_names_exists():
    """When a module moves or goes, the pages that name it say so (the manual must not describe a past layout)."""
    modules = [path.relative_to(ROOT).as_posix() for folder in ("src", "tests", "configs", "bench")
               for path in (ROOT / folder).rglob("*.py")]
    missing = sorted({f"{page.relative_to(ROOT)}: {name}" for page in [ROOT / "README.md", *DOCS.rglob("*.md")]
                      for name in MODULE.findall(page.read_text())
                      if name not in EXAMPLES and not any(m == name or m.endswith("/" + name) for m in modules)})
    assert missing == []


def test_the_architecture_page_names_every_folder_of_the_package():
    """The map a newcomer reads first leaves no room out: every package folder and every floor of learner/."""
    text = (DOCS / "architecture.md").read_text()
    package = ROOT / "src" / "grpo_fleet"
    folders = [path.relative_to(package).as_posix() for path in [*package.iterdir(), *(package / "learner").iterdir()]
               if path.is_dir() and (path / "__init__.py").exists()]
    assert [folder for folder in folders if f"{folder}/" not in text and f"{folder.split('/')[-1]}/" not in text] == []


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = _mkdocs_config()
    assert config["strict"] is True
    nav = _nav_pages(config["nav"])
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - pages == set(), "nav entries with no page"


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs gives a page's headings (its default slugify)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(re.sub(r"[`*]", "", title), "-") for title in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    broken = []
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for target in _relative_links(path):
            file, _, anchor = target.partition("#")
            linked = path.parent / file
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []

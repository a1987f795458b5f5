"""The manual's generated references (docs/reference/): the configuration and the metrics, written from the code.

Each page keeps its prose by hand and its tables between markers; `make reference`
(or `make readme`, its older name; `python -m grpo_fleet.cli.docs_reference`) rewrites the tables, and `--check`, run by
`make docs` and `make test`, fails when a page no longer says what the code does:
a config field or a metric added, renamed, or described anew.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable, Optional, cast

from prometheus_client import CollectorRegistry

from grpo_fleet.config import config_reference

DOCS = Path(__file__).resolve().parents[3] / "docs"


@dataclass(frozen=True)
class MetricDoc:
    """One metric family as a scrape shows it."""

    name: str  # as exported: a counter with its `_total`
    kind: str
    labels: tuple[str, ...]
    meaning: str


def metric_docs(registry: CollectorRegistry) -> list[MetricDoc]:
    """Every family `registry` exports, in the order it was registered, with its label names.

    A family's label names are known before any child exists only to its collector
    (prometheus_client keeps them as `_labelnames`); a scrape lists none until a value is set.
    """
    docs = []
    for collector in list(getattr(registry, "_collector_to_names", {})):
        describe = getattr(collector, "describe", None)
        families = describe() if describe is not None and getattr(collector, "_labelnames", None) is not None \
            else collector.collect()
        for family in families:
            labels: tuple[str, ...] = tuple(getattr(collector, "_labelnames", ()) or getattr(family, "_labelnames", ()))
            name = family.name + ("_total" if family.type == "counter" else "")
            docs.append(MetricDoc(name, family.type, tuple(label for label in labels if label != "le"),
                                  family.documentation))
    return docs


def config_table() -> str:
    """Every config key with its default and meaning, from the field descriptions in config.py."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {text} |" for key, default, text in config_reference()]
    return "\n".join(lines)


def metrics_table(docs: Iterable[MetricDoc]) -> str:
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for doc in docs:
        labels = ", ".join(f"`{label}`" for label in doc.labels)
        lines.append(f"| `{doc.name}` | {doc.kind} | {labels} | {doc.meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)


def _learner_registry() -> CollectorRegistry:
    from grpo_fleet.observe.metrics import learner_metrics

    return learner_metrics().registry


def _actor_registry() -> CollectorRegistry:
    from grpo_fleet.observe.metrics import actor_metrics

    return actor_metrics().registry


def _rank_registry() -> CollectorRegistry:
    """What a data-parallel rank other than 0 serves (its collective counters rank 0 serves too)."""
    from grpo_fleet.learner.ranks.collectives import RankGroup
    from grpo_fleet.learner.ranks.rank_metrics import follower_metrics

    ranks = SimpleNamespace(rank=1, totals={}, refusals={}, listener=SimpleNamespace(rang=0, missed=0))
    return follower_metrics(cast(RankGroup, ranks)).registry


def _server_registry() -> CollectorRegistry:
    from grpo_fleet.observe.metrics_http import refusal_counter

    registry = CollectorRegistry()
    refusal_counter(registry)
    return registry


# Section name -> the registry it documents, in the page's order.
METRIC_SECTIONS: dict[str, Callable[[], CollectorRegistry]] = {
    "learner": _learner_registry,
    "actor": _actor_registry,
    "ranks": _rank_registry,
    "server": _server_registry,
}


def generated_sections() -> dict[str, dict[str, str]]:
    """Page (relative to docs/) -> section name -> the text between that section's markers."""
    return {
        "reference/configuration.md": {"config": config_table()},
        "reference/metrics.md": {name: metrics_table(metric_docs(make())) for name, make in METRIC_SECTIONS.items()},
    }


def markers(section: str) -> tuple[str, str]:
    return f"<!-- generated:{section}:start (regenerate: make reference) -->\n", f"<!-- generated:{section}:end -->"


def refreshed(text: str, sections: dict[str, str]) -> str:
    """`text` with each section's markers holding its generated text; a page missing a marker is an error."""
    for section, body in sections.items():
        start, end = markers(section)
        if start not in text or end not in text:
            raise ValueError(f"no markers for the generated section {section!r}: {start.strip()} ... {end.strip()}")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + start + body + "\n" + end + tail
    return text


def stale_pages(docs: Path = DOCS) -> list[str]:
    """The generated pages under `docs` whose tables differ from what the code says now."""
    return [page for page, sections in generated_sections().items()
            if refreshed((docs / page).read_text(), sections) != (docs / page).read_text()]


def refresh(docs: Path = DOCS) -> list[str]:
    """Rewrite every generated table under `docs`; the pages that changed."""
    changed = []
    for page, sections in generated_sections().items():
        path = docs / page
        text = path.read_text()
        updated = refreshed(text, sections)
        if updated != text:
            path.write_text(updated)
            changed.append(page)
    return changed


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_fleet.cli.docs_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated page is stale")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs folder (default: the checkout's)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages(args.docs)
        for page in stale:
            print(f"docs/{page} no longer matches the code: run `make reference` and commit it", file=sys.stderr)
        return 1 if stale else 0
    for page in refresh(args.docs):
        print(f"rewrote docs/{page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

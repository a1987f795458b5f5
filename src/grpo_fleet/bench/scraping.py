"""Reading a running learner's /metrics from a benchmark (the page Prometheus scrapes)."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Scraped:
    """Every sample of one /metrics page: (sample name, labels as sorted pairs) -> value."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (0 when none)."""
        wanted = set(labels.items())
        return sum(v for (n, pairs), v in self.samples.items() if n == name and wanted <= set(pairs))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """`label`'s value -> the sample's value, for the samples called `name` that carry `label`."""
        return {dict(pairs)[label]: v for (n, pairs), v in self.samples.items() if n == name and label in dict(pairs)}


def parse(text: str) -> Scraped:
    scraped = Scraped()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            scraped.samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return scraped


def scrape(port: int, timeout: float = 2.0) -> Optional[Scraped]:
    """GET http://127.0.0.1:PORT/metrics; None while nothing answers there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            return parse(response.read().decode())
    except OSError:
        return None

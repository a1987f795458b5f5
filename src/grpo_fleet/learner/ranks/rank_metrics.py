"""Prometheus metrics of a data-parallel learner's ranks.

Every rank counts the seconds and bytes of each `mx.distributed` collective it
ran (`RankGroup.totals`); rank 0 exports them with the learner's metrics. A
rank other than 0 has no learner to export from, so it serves its own small
registry: those counters, its steps and their seconds, on `metrics.port +
rank` (the learner's host), or a free port if that one is taken.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from grpo_fleet.config import MetricsConfig
from grpo_fleet.learner.ranks.collectives import RankGroup
from grpo_fleet.observe.metrics import PREFIX
from grpo_fleet.observe.metrics_http import MetricsServer, serve_metrics

log = logging.getLogger("grpo_fleet.learner.ranks")
LEARNER = PREFIX + "_learner"


class CollectiveTotals(Collector):
    """`RankGroup.totals`, read at scrape time: nothing is added to the collectives' own path."""

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks

    def collect(self) -> Iterator[CounterMetricFamily]:
        seconds = CounterMetricFamily(f"{LEARNER}_collective_seconds", "Seconds in each mx.distributed collective "
                                      "(waiting for the other ranks included), by rank", labels=["collective", "rank"])
        sent = CounterMetricFamily(f"{LEARNER}_collective_bytes", "Bytes each rank put into each mx.distributed "
                                   "collective", labels=["collective", "rank"])
        for what, (waited, nbytes) in sorted(self.ranks.totals.items()):
            seconds.add_metric([what, str(self.ranks.rank)], waited)
            sent.add_metric([what, str(self.ranks.rank)], nbytes)
        refused = CounterMetricFamily(f"{LEARNER}_ring_refusals", "What a rank refused before or over the ring: "
                                      "knocks at rank 0's ring door (a key not allowed, a malformed or repeated knock), "
                                      "failed ring proofs, messages or a rank's gathered part whose HMAC failed (bad "
                                      "tag), a broadcast of bytes past its bound (oversized)", labels=["reason", "rank"])
        for reason, count in sorted(self.ranks.refusals.items()):
            refused.add_metric([reason, str(self.ranks.rank)], count)
        waits = CounterMetricFamily(f"{LEARNER}_rank_doorbell_waits", "A rank other than 0's waits for rank 0's next "
                                    "broadcast on its doorbell, by how they ended: rang, or silent (three heartbeats "
                                    "unheard; the rank waited in MLX's ring instead, spinning a core)",
                                    labels=["result", "rank"])
        listener = self.ranks.listener
        if listener is not None:
            waits.add_metric(["rang", str(self.ranks.rank)], listener.rang)
            waits.add_metric(["silent", str(self.ranks.rank)], listener.missed)
        yield seconds
        yield sent
        yield refused
        yield waits


@dataclass
class FollowerMetrics:
    """What a rank other than 0 exports."""

    registry: CollectorRegistry
    steps: Counter
    step_seconds: Histogram
    recomputed: Counter

    def observe_step(self, started: float, recomputed_rows: int = 0) -> None:
        self.steps.inc()
        self.step_seconds.observe(time.perf_counter() - started)
        self.recomputed.inc(recomputed_rows)


def follower_metrics(ranks: RankGroup) -> FollowerMetrics:
    registry = CollectorRegistry()
    registry.register(CollectiveTotals(ranks))
    labels = {"rank": str(ranks.rank)}
    return FollowerMetrics(
        registry=registry,
        steps=Counter(f"{LEARNER}_rank_steps", "Steps this rank trained its share of", labelnames=list(labels),
                      registry=registry).labels(**labels),
        step_seconds=Histogram(f"{LEARNER}_rank_step_seconds", "Wall time of this rank's share of a step, "
                               "all-reduce included", labelnames=list(labels), registry=registry).labels(**labels),
        recomputed=Counter(f"{LEARNER}_rank_check_completions", "Completions of older groups this rank recomputed "
                           "at their versions for the logprob check, its rows of them", labelnames=list(labels),
                           registry=registry).labels(**labels),
    )


def serve_follower_metrics(metrics: FollowerMetrics, cfg: MetricsConfig, rank: int) -> Optional[MetricsServer]:
    """/metrics on the learner's port + rank (a free port if that one is taken); none when the learner serves
    none (port 0), or when `metrics.host` is not an address of this machine (rank 0's own IP, on another
    Mac): a rank without metrics still trains, a rank that exits stops the run."""
    if not cfg.port:
        return None
    for port, any_port in ((cfg.port + rank, False), (0, True)):
        try:
            server = serve_metrics(metrics.registry, cfg.host, port, any_port=any_port)
        except OSError as exc:
            log.warning("rank %d: cannot serve metrics on %s:%d (%s)", rank, cfg.host, port, exc)
            continue
        if server is not None:
            log.info("rank %d: metrics on http://%s:%d/metrics", rank, cfg.host, server.port)
        return server
    log.warning("rank %d: no metrics (set metrics.host to 0.0.0.0 to serve them on every rank's Mac)", rank)
    return None

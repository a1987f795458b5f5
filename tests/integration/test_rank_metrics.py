"""A data-parallel rank's own /metrics (learner/ranks/rank_metrics.py): served on the learner's port + rank,
elsewhere when that is taken, and never fatal to the rank."""

from __future__ import annotations

import socket
from types import SimpleNamespace

from grpo_fleet.config import MetricsConfig
from grpo_fleet.learner.ranks.rank_metrics import follower_metrics, serve_follower_metrics
from helpers import free_port_pair, scrape


def _metrics(rank: int = 1):
    ranks = SimpleNamespace(rank=rank, totals={"gradient all-sum": [1.5, 4096.0]},  # what RankGroup counts
                            refusals={"bad tag": 1}, listener=SimpleNamespace(rang=5, missed=1))
    return follower_metrics(ranks)  # type: ignore[arg-type]


def test_a_rank_serves_its_collectives_and_steps_on_the_learners_port_plus_its_rank():
    port = free_port_pair()
    metrics = _metrics(rank=1)
    metrics.observe_step(0.0)
    server = serve_follower_metrics(metrics, MetricsConfig(host="127.0.0.1", port=port), rank=1)
    assert server is not None and server.port == port + 1
    try:
        page = scrape(server.port)
        assert page.value("grpo_fleet_learner_collective_seconds_total", collective="gradient all-sum", rank="1") == 1.5
        assert page.value("grpo_fleet_learner_collective_bytes_total", rank="1") == 4096.0
        assert page.value("grpo_fleet_learner_rank_steps_total", rank="1") == 1.0
        assert page.value("grpo_fleet_learner_ring_refusals_total", reason="bad tag", rank="1") == 1.0
        assert page.value("grpo_fleet_learner_rank_doorbell_waits_total", result="silent", rank="1") == 1.0
    finally:
        server.close()


def test_a_taken_port_moves_the_ranks_metrics_and_no_port_means_none(free_port):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        server = serve_follower_metrics(_metrics(), MetricsConfig(host="127.0.0.1", port=port), rank=1)
    assert server is not None and server.port != port + 1
    server.close()
    assert serve_follower_metrics(_metrics(), MetricsConfig(host="127.0.0.1", port=0), rank=1) is None


def test_rank_0s_own_address_on_another_mac_leaves_the_rank_without_metrics_not_dead(free_port):
    # 192.0.2.1 (TEST-NET-1) is no address of this machine, as rank 0's LAN IP is none of another Mac's.
    assert serve_follower_metrics(_metrics(), MetricsConfig(host="192.0.2.1", port=free_port()), rank=1) is None

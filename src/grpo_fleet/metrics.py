"""Prometheus metrics for the learner and the actors, one registry per process.

Names follow Prometheus conventions: the `grpo_fleet_` prefix, base units in the
name, `_total` on counters, low-cardinality labels only.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PREFIX = "grpo_fleet"
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
REWARD_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass
class LearnerMetrics:
    """Everything the learner exports."""

    registry: CollectorRegistry
    steps: Counter
    policy_version: Gauge
    reward: Gauge
    loss: Gauge
    kl: Gauge
    clip_fraction: Gauge
    zero_variance_fraction: Gauge
    tokens_accepted: Counter
    groups_accepted: Counter
    groups_zero_variance: Counter
    rejections: Counter
    protocol_errors: Counter
    leases_issued: Counter
    leases_expired: Counter
    leases_outstanding: Gauge
    staleness: Histogram
    group_reward: Histogram
    step_seconds: Histogram
    weight_bytes_served: Counter
    actors_connected: Gauge
    auth_failures: Counter


def learner_metrics() -> LearnerMetrics:
    """Create the learner's registry and metrics."""
    r = CollectorRegistry()
    p = PREFIX + "_learner"
    return LearnerMetrics(
        registry=r,
        steps=Counter(f"{p}_steps", "Optimizer batches trained", registry=r),
        policy_version=Gauge(f"{p}_policy_version", "Current published policy version", registry=r),
        reward=Gauge(f"{p}_reward_mean", "Mean reward of the last training batch", registry=r),
        loss=Gauge(f"{p}_loss", "Loss of the last step", registry=r),
        kl=Gauge(f"{p}_kl", "Masked mean k3 KL to pi_ref in the last step", registry=r),
        clip_fraction=Gauge(f"{p}_clip_fraction", "Fraction of clipped tokens in the last step", registry=r),
        zero_variance_fraction=Gauge(
            f"{p}_zero_variance_fraction", "Share of accepted groups with identical rewards (collapse signal)", registry=r
        ),
        tokens_accepted=Counter(f"{p}_tokens_accepted", "Completion tokens accepted", registry=r),
        groups_accepted=Counter(f"{p}_groups_accepted", "Groups accepted", registry=r),
        groups_zero_variance=Counter(f"{p}_groups_zero_variance", "Accepted groups skipped for zero variance", registry=r),
        rejections=Counter(f"{p}_rejections", "Rollout groups rejected, by reason", ["reason"], registry=r),
        protocol_errors=Counter(f"{p}_protocol_errors", "Messages that failed to decode or validate, by reason", ["reason"], registry=r),
        leases_issued=Counter(f"{p}_leases_issued", "Leases handed out", registry=r),
        leases_expired=Counter(f"{p}_leases_expired", "Leases that expired and were re-queued", registry=r),
        leases_outstanding=Gauge(f"{p}_leases_outstanding", "Leases not yet returned", registry=r),
        staleness=Histogram(f"{p}_staleness_versions", "Policy versions behind at acceptance", buckets=STALENESS_BUCKETS, registry=r),
        group_reward=Histogram(f"{p}_group_reward", "Mean reward per accepted group", buckets=REWARD_BUCKETS, registry=r),
        step_seconds=Histogram(f"{p}_step_duration_seconds", "Wall time of one optimizer batch", registry=r),
        weight_bytes_served=Counter(f"{p}_weight_sent_bytes", "Weight bytes sent to actors", registry=r),
        actors_connected=Gauge(f"{p}_actors_connected", "Actors heard from within the heartbeat timeout", registry=r),
        auth_failures=Counter(
            f"{p}_auth_failures", "Refused CURVE handshakes and messages from revoked keys, by reason", ["reason"], registry=r
        ),
    )


@dataclass
class ActorMetrics:
    """Everything an actor exports."""

    registry: CollectorRegistry
    groups_generated: Counter
    tokens_generated: Counter
    generation_seconds: Histogram
    reward: Histogram
    acks: Counter
    policy_version: Gauge
    weight_syncs: Counter
    reconnects: Counter


def actor_metrics() -> ActorMetrics:
    """Create an actor's registry and metrics."""
    r = CollectorRegistry()
    p = PREFIX + "_actor"
    return ActorMetrics(
        registry=r,
        groups_generated=Counter(f"{p}_groups_generated", "Groups generated and scored", registry=r),
        tokens_generated=Counter(f"{p}_tokens_generated", "Completion tokens generated", registry=r),
        generation_seconds=Histogram(f"{p}_generation_duration_seconds", "Wall time to generate one lease", registry=r),
        reward=Histogram(f"{p}_completion_reward", "Reward of each completion", buckets=REWARD_BUCKETS, registry=r),
        acks=Counter(f"{p}_acks", "Acks received from the learner, by status", ["status"], registry=r),
        policy_version=Gauge(f"{p}_policy_version", "Policy version of the loaded snapshot", registry=r),
        weight_syncs=Counter(f"{p}_weight_syncs", "Snapshots loaded, by outcome", ["outcome"], registry=r),
        reconnects=Counter(f"{p}_reconnects", "Times the actor re-registered with the learner", registry=r),
    )


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> None:
    """Start the /metrics HTTP server in a daemon thread; port 0 disables it."""
    if port:
        start_http_server(port, addr=host, registry=registry)

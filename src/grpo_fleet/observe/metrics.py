"""Prometheus metrics for the learner and the actors, one registry per process (served by observe/metrics_http.py).

Names follow Prometheus conventions: the `grpo_fleet_` prefix, base units in the
name, `_total` on counters, low-cardinality labels only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("grpo_fleet.observe.metrics")

PREFIX = "grpo_fleet"
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
LEASE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LENGTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TURN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)
GAP_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 0.003, 0.01, 0.03, 0.05, 0.1, 0.3, 1.0, 3.0)
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
    ratio_mean: Gauge
    offpolicy_gap_mean: Gauge
    offpolicy_gap_max: Gauge
    is_capped_fraction: Gauge
    completion_length_mean: Gauge
    completion_length_max: Gauge
    truncated_fraction: Gauge
    learning_rate: Gauge
    zero_variance_fraction: Gauge
    tokens_accepted: Counter
    groups_accepted: Counter
    groups_zero_variance: Counter
    rejections: Counter
    protocol_errors: Counter
    internal_errors: Counter
    leases_issued: Counter
    fair_share_refusals: Counter
    leases_expired: Counter
    late_groups: Counter
    leases_extended: Counter
    leases_outstanding: Gauge
    lease_groups: Histogram
    staleness: Histogram
    group_reward: Histogram
    step_seconds: Histogram
    weight_bytes_served: Counter
    weight_reply_bytes_held: Gauge
    weights_refusals: Counter
    actors_connected: Gauge
    auth_failures: Counter
    connections_dropped: Counter
    step_phase_seconds: Histogram
    weight_publish_seconds: Histogram
    rollouts_answer_seconds: Histogram
    weight_publish_bytes: Gauge
    violations: Counter
    bans: Counter
    banned_peers: Gauge
    skipped_updates: Counter
    groups_unscored: Counter
    groups_unscorable: Counter
    unscored_requeues: Counter
    logprob_gap: Histogram
    logprob_check_seconds: Histogram
    logprob_checks: Counter
    groups_unchecked: Counter
    step_check_seconds: Histogram
    train_staleness: Histogram
    stale_group_tokens: Histogram
    accepted_group_tokens: Histogram
    episode_tokens: Counter
    episode_turns: Histogram
    episodes_ended: Counter
    eval_reward: Gauge
    eval_pass_at_k: Gauge
    eval_rounds: Counter
    eval_leases: Counter
    peak_memory: Gauge
    tracker_errors: Counter


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
        ratio_mean=Gauge(f"{p}_ratio_mean", "Mean importance ratio over the last step's tokens: pi_theta / pi_behav "
                         "(coupled) or pi_theta / pi_prox (decoupled)", registry=r),
        offpolicy_gap_mean=Gauge(f"{p}_offpolicy_gap_mean", "Mean |log pi_prox - log pi_behav| over the last step's tokens",
                                 registry=r),
        offpolicy_gap_max=Gauge(f"{p}_offpolicy_gap_max", "Max |log pi_prox - log pi_behav| over the last step's tokens",
                                registry=r),
        is_capped_fraction=Gauge(f"{p}_is_capped_fraction",
                                 "Share of the last step's tokens whose behaviour weight was truncated or masked at "
                                 "grpo.is_cap", registry=r),
        completion_length_mean=Gauge(f"{p}_completion_length_mean", "Mean completion length of the last step, in tokens",
                                     registry=r),
        completion_length_max=Gauge(f"{p}_completion_length_max", "Longest completion of the last step, in tokens",
                                    registry=r),
        truncated_fraction=Gauge(f"{p}_truncated_fraction",
                                 "Share of the last step's completions cut off at generation.max_tokens", registry=r),
        learning_rate=Gauge(f"{p}_learning_rate", "Learning rate of the last applied update (the schedule's value)",
                            registry=r),
        zero_variance_fraction=Gauge(
            f"{p}_zero_variance_fraction", "Share of accepted groups with identical rewards (collapse signal)", registry=r
        ),
        tokens_accepted=Counter(f"{p}_tokens_accepted", "Completion tokens accepted", registry=r),
        groups_accepted=Counter(f"{p}_groups_accepted", "Groups accepted", registry=r),
        groups_zero_variance=Counter(f"{p}_groups_zero_variance", "Accepted groups skipped for zero variance", registry=r),
        rejections=Counter(f"{p}_rejections", "Rollout groups rejected, by reason", ["reason"], registry=r),
        protocol_errors=Counter(f"{p}_protocol_errors", "Messages that failed to decode or validate, by reason", ["reason"],
                                registry=r),
        internal_errors=Counter(f"{p}_internal_errors", "Requests the learner failed on by its own bug (never charged "
                                "to the peer), by where: decode or handle", ["where"], registry=r),
        leases_issued=Counter(f"{p}_leases_issued", "Leases handed out", registry=r),
        fair_share_refusals=Counter(
            f"{p}_fair_share_refusals", "Requests refused so that one actor cannot take more than its share, by reason: "
            "actor_cap (a lease beyond what the actor can finish within server.lease_seconds), fair_share (a lease "
            "beyond the key's equal share of the in-flight budget plus one lease), busy (Rollouts while the "
            "verifier's queue is full; resent later)", ["reason"], registry=r),
        leases_expired=Counter(f"{p}_leases_expired", "Leases that expired and were re-queued", registry=r),
        late_groups=Counter(f"{p}_late_groups", "Groups taken from a lease past its deadline (its work was not thrown "
                            "away), by kind: train or eval", ["kind"], registry=r),
        leases_extended=Counter(f"{p}_leases_extended", "Leases past their deadline given another lease_seconds "
                                "(their actor still heartbeating; up to server.max_lease_seconds), by kind: train "
                                "or eval", ["kind"], registry=r),
        leases_outstanding=Gauge(f"{p}_leases_outstanding", "Leases not yet returned", registry=r),
        lease_groups=Histogram(
            f"{p}_lease_groups", "Groups per lease, sized to each actor's measured speed", buckets=LEASE_BUCKETS, registry=r
        ),
        staleness=Histogram(f"{p}_staleness_versions", "Policy versions behind at acceptance", buckets=STALENESS_BUCKETS,
                            registry=r),
        group_reward=Histogram(f"{p}_group_reward", "Mean reward per accepted group", buckets=REWARD_BUCKETS, registry=r),
        step_seconds=Histogram(f"{p}_step_duration_seconds", "Wall time of one optimizer batch", registry=r),
        weight_bytes_served=Counter(f"{p}_weight_sent_bytes", "Weight bytes sent to actors", registry=r),
        weight_reply_bytes_held=Gauge(
            f"{p}_weight_reply_bytes_held", "Bytes of the weight blobs that chunks still queued for peers keep alive "
            "(each distinct version once; a blob the snapshot store keeps too is counted)", registry=r),
        weights_refusals=Counter(
            f"{p}_weights_refusals", "Weight requests answered WeightsGone to bound the blobs queued chunks hold, by "
            "reason: peer_busy (this peer key's earlier chunks are still queued, of another version or too many), "
            "versions_cap (queued chunks already hold the most distinct versions)", ["reason"], registry=r),
        actors_connected=Gauge(f"{p}_actors_connected", "Actors heard from within the heartbeat timeout", registry=r),
        connections_dropped=Counter(
            f"{p}_connections_dropped", "Actor connections that ended: libzmq drops one whose message is over the "
            "inbound limit (server.max_message_bytes or less), with the message and unseen by anything else; an actor "
            "that exits or loses its network ends one too", registry=r,
        ),
        auth_failures=Counter(
            f"{p}_auth_failures",
            "Refused CURVE handshakes, messages from revoked keys, and requests other than Status from observer keys, "
            "by reason", ["reason"], registry=r,
        ),
        step_phase_seconds=Histogram(
            f"{p}_step_phase_seconds", "Wall time of each phase of a learner step", ["phase"], buckets=PHASE_BUCKETS, registry=r
        ),
        weight_publish_seconds=Histogram(
            f"{p}_weight_publish_seconds", "Time to serialize and digest a new policy version", buckets=PHASE_BUCKETS, registry=r
        ),
        rollouts_answer_seconds=Histogram(
            f"{p}_rollouts_answer_seconds", "Time to answer one Rollouts: rewards re-scored, logprobs re-checked, "
            "groups taken (the learner's work per submission besides training)", buckets=PHASE_BUCKETS, registry=r
        ),
        weight_publish_bytes=Gauge(f"{p}_weight_publish_bytes", "Size of the latest published weight blob", registry=r),
        violations=Counter(f"{p}_violations", "Malformed or hostile messages counted toward a ban, by reason", ["reason"],
                           registry=r),
        bans=Counter(f"{p}_bans", "Peers banned after server.max_violations violations", registry=r),
        banned_peers=Gauge(f"{p}_banned_peers", "Peers banned right now", registry=r),
        skipped_updates=Counter(
            f"{p}_skipped_updates", "Batches whose update was not applied (non-finite loss or gradient), by reason",
            ["reason"], registry=r,
        ),
        groups_unscored=Counter(
            f"{p}_groups_unscored", "Groups actors could not score (a reward failed), re-queued; by reward and error",
            ["reward", "error"], registry=r,
        ),
        groups_unscorable=Counter(
            f"{p}_groups_unscorable", "Prompts given up on for this pass after repeated unscorable groups", registry=r
        ),
        unscored_requeues=Counter(
            f"{p}_unscored_requeues", "Groups sent back unscored and re-queued, by where they may go: another_key (not "
            "to the key that returned it, while another is live), any_key (a fleet of one key)", ["to"], registry=r,
        ),
        logprob_gap=Histogram(
            f"{p}_logprob_gap_nats", "Mean |reported - recomputed| token logprob of each checked group "
            "(security.max_logprob_gap)", buckets=GAP_BUCKETS, registry=r,
        ),
        logprob_check_seconds=Histogram(
            f"{p}_logprob_check_seconds", "Time to recompute one checked group's logprobs, on the training thread "
            "before the step that takes it", buckets=PHASE_BUCKETS, registry=r,
        ),
        logprob_checks=Counter(
            f"{p}_logprob_checks", "Groups whose logprobs were checked before training, by how (fused: against the "
            "step's own forward; forward: recomputed at their version; screen: an older group's tokens against the step's "
            "forward, under security.screen_token_nats) and result (passed, failed; for screen, failed groups are "
            "recomputed whole and the honest counted again as cleared)", ["how", "result"],
            registry=r,
        ),
        groups_unchecked=Counter(
            f"{p}_groups_unchecked", "Groups trained without a logprob check, by reason (sampled_out: not drawn after "
            "probation; verification_off: security.verify_logprobs = false; version_gone: its weights were not kept)",
            ["reason"], registry=r,
        ),
        step_check_seconds=Histogram(
            f"{p}_step_check_seconds", "Seconds each step spent checking its groups' logprobs, on its slowest "
            "rank (the metrics.jsonl line's check_seconds)", buckets=PHASE_BUCKETS, registry=r,
        ),
        train_staleness=Histogram(f"{p}_train_staleness_versions", "Policy versions behind when trained",
                                  buckets=STALENESS_BUCKETS, registry=r),
        stale_group_tokens=Histogram(
            f"{p}_stale_group_tokens", "Mean completion length of groups refused as too stale (length bias check)",
            buckets=LENGTH_BUCKETS, registry=r,
        ),
        accepted_group_tokens=Histogram(f"{p}_accepted_group_tokens", "Mean completion length of accepted groups",
                                        buckets=LENGTH_BUCKETS, registry=r),
        episode_tokens=Counter(f"{p}_episode_tokens", "Tokens of accepted episodes (task.env) by kind: sampled by the "
                               "model or given by the environment", ["kind"], registry=r),
        episode_turns=Histogram(f"{p}_episode_turns", "Turns (model replies) per accepted episode",
                                buckets=TURN_BUCKETS, registry=r),
        episodes_ended=Counter(f"{p}_episodes_ended", "Accepted episodes by why they ended (done, max_turns, budget)",
                               ["end"], registry=r),
        eval_reward=Gauge(f"{p}_eval_reward", "Held-out avg@k reward of the last complete eval round", registry=r),
        eval_pass_at_k=Gauge(f"{p}_eval_pass_at_k", "Held-out pass@k of the last complete eval round", registry=r),
        eval_rounds=Counter(f"{p}_eval_rounds", "Eval rounds started (train.eval_every)", registry=r),
        eval_leases=Counter(f"{p}_eval_leases", "Eval leases handed out (never training groups)", registry=r),
        peak_memory=Gauge(f"{p}_peak_memory_bytes", "MLX peak memory during the last step (reset every step)", registry=r),
        tracker_errors=Counter(f"{p}_tracker_errors", "Experiment-tracker calls that raised (training went on), by tracker",
                               ["tracker"], registry=r),
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
    policy_lag: Gauge
    weight_fetch_seconds: Histogram
    submit_retries: Counter
    reward_errors: Counter
    reward_seconds: Histogram
    peak_memory: Gauge
    episode_tokens: Counter
    episode_turns: Histogram
    episodes_ended: Counter
    env_seconds: Histogram
    idle_slots: Gauge
    drains: Counter
    drain_idle_slots: Counter


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
        policy_lag=Gauge(f"{p}_policy_lag_versions",
                         "Versions between the learner's current policy and the loaded one (either way)", registry=r),
        weight_fetch_seconds=Histogram(
            f"{p}_weight_fetch_seconds", "Time to fetch, verify and load a new policy version", buckets=PHASE_BUCKETS, registry=r
        ),
        submit_retries=Counter(f"{p}_submit_retries", "Rollout submissions resent after a lost answer or reconnect", registry=r),
        reward_errors=Counter(
            f"{p}_reward_errors", "Reward calls that failed (raised, non-finite, out of bounds, timed out, no score), "
            "each failing its group; by reward and error", ["reward", "error"], registry=r,
        ),
        reward_seconds=Histogram(f"{p}_reward_duration_seconds", "Time one reward took over one group, by reward",
                                 ["reward"], buckets=PHASE_BUCKETS, registry=r),
        peak_memory=Gauge(f"{p}_peak_memory_bytes", "MLX peak memory while generating the last lease", registry=r),
        episode_tokens=Counter(f"{p}_episode_tokens", "Tokens of finished episodes by kind: sampled by the model or "
                               "given by the environment", ["kind"], registry=r),
        episode_turns=Histogram(f"{p}_episode_turns", "Turns per finished episode", buckets=TURN_BUCKETS, registry=r),
        episodes_ended=Counter(f"{p}_episodes_ended", "Finished episodes by why they ended (done, max_turns, budget)",
                               ["end"], registry=r),
        env_seconds=Histogram(f"{p}_env_seconds", "Seconds one episode spent in its environment's calls (init, steps, "
                              "close)", buckets=PHASE_BUCKETS, registry=r),
        idle_slots=Gauge(f"{p}_idle_slot_fraction", "Share of the rolling batch's (decoding step x slot) cells with no "
                         "sequence in them, over this actor's life: 1 - active rows / (steps x batch size)", registry=r),
        drains=Counter(f"{p}_drains", "Times the rolling batch stopped taking new work until its sequences finished, "
                       "by reason: a newer policy version to load, or an eval lease to run alone", ["reason"], registry=r),
        drain_idle_slots=Counter(f"{p}_drain_idle_slots", "Idle (decoding step x slot) cells while draining: what "
                                 "the drains cost", registry=r),
    )

"""Tests for grpo_fleet.learner.run.coordinator.RunCoordinator, driven through `handle()` without sockets."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import mlx_lm
import numpy as np
import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.door.replies import Reply
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.models.generation import SamplingSettings, generate_groups
from grpo_fleet.models.loading import model_digest
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from helpers import assert_checkpoint_generates_like_the_learner
from in_process import build_learner

GROUP_SIZE = 4
MAX_TOKENS = 3  # crafted completions are 3 tokens, cut off at max_tokens ("length", as finish_reason must say)
GROUPS_PER_STEP = 2
ACTOR_A = b"actor-a-identity"
ACTOR_B = b"actor-b-identity"
STEP_RECORD_KEYS = {
    "step", "policy_version", "reward_mean", "loss", "kl", "clip_fraction",
    "groups", "tokens", "staleness_mean", "step_seconds", "skipped", "peak_memory_bytes",
}
INFORMATIVE = [0.0, 0.25, 0.5, 1.0]
FLAT = [0.5, 0.5, 0.5, 0.5]


def run_config(model_dir: Path, run_dir: Path, **sections: dict) -> RunConfig:
    data = {
        "run_dir": str(run_dir),
        "model": {"path": str(model_dir)},
        "task": {"name": "reverse", "num_train": 50, "num_eval": 8},
        "generation": {"group_size": GROUP_SIZE, "max_tokens": MAX_TOKENS},
        "grpo": {"groups_per_step": GROUPS_PER_STEP, "beta": 0.04},
        "train": {"steps": 3, "checkpoint_every": 1},
        "metrics": {"port": 0},
        # These tests send crafted rollouts; the checks of honest ones are tested in test_verification.py
        # (and re-scoring starts a process, which unit tests may not).
        "security": {"verify_rewards": False, "verify_logprobs": False},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return RunConfig.model_validate(data)


@pytest.fixture
def make_learner(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., RunCoordinator]]:
    built: list[RunCoordinator] = []

    def make(**sections: dict) -> RunCoordinator:
        learner = build_learner(run_config(tiny_model_dir, tmp_path / f"run{len(built)}", **sections))
        built.append(learner)
        return learner

    yield make
    for learner in built:
        learner.close()


@pytest.fixture
def learner(make_learner) -> RunCoordinator:
    return make_learner()


# ----------------------------------------------------------------- helpers


def ask(learner: RunCoordinator, identity: bytes, msg: object, **kwargs) -> object:
    """The message `handle` answers with (weight chunks carry raw bytes too; see the weights tests)."""
    reply = learner.handle(identity, msg, **kwargs)
    assert isinstance(reply, Reply)
    return reply.message


def hello(learner: RunCoordinator, identity: bytes = ACTOR_A, actor_id: str = "actor-a") -> m.Welcome:
    reply = ask(learner, identity, m.Hello(actor_id=actor_id, host="testhost", backend="cpu", versions={}))
    assert isinstance(reply, m.Welcome)
    return reply


def lease(learner: RunCoordinator, identity: bytes = ACTOR_A, max_groups: int = GROUPS_PER_STEP) -> m.Lease:
    reply = ask(learner, identity, m.LeaseRequest(max_groups=max_groups))
    assert isinstance(reply, m.Lease)
    return reply


def completion(tokens: Sequence[int], logprobs: Sequence[float], reward: float) -> m.Completion:
    return m.Completion(
        tokens=m.Tensor.from_numpy(np.asarray(tokens, dtype=np.int32)),
        logprobs=m.Tensor.from_numpy(np.asarray(logprobs, dtype=np.float32)),
        reward=float(reward),
        finish_reason="length",
    )


def crafted_group(group_id: str, rewards: Sequence[float], *, token: int = 7, logprob: float = -1.5,
                  length: int = 3) -> m.GroupResult:
    """One completion per reward; completion i repeats token `token + i % 3`."""
    return m.GroupResult(
        group_id=group_id,
        completions=[
            completion([token + i % 3] * length, [logprob - 0.1 * i] * length, reward) for i, reward in enumerate(rewards)
        ],
    )


def rollouts_for(lease_msg: m.Lease, rewards: Sequence[float] = INFORMATIVE, *, version: Optional[int] = None,
                 incarnation: str = "", **group_kwargs) -> m.Rollouts:
    return m.Rollouts(
        lease_id=lease_msg.lease_id,
        policy_version=lease_msg.policy_version if version is None else version,
        incarnation=incarnation,
        groups=[crafted_group(p.group_id, rewards, **group_kwargs) for p in lease_msg.prompts],
    )


def generated_rollouts(learner: RunCoordinator, lease_msg: m.Lease) -> m.Rollouts:
    """Real samples from the learner's own policy, with rewards spread so every group is informative."""
    prompts = [p.prompt_tokens.to_numpy() for p in lease_msg.prompts]
    groups = generate_groups(
        learner.policy.model, prompts, SamplingSettings(group_size=GROUP_SIZE, max_tokens=MAX_TOKENS,
                                                        stop_token_ids=sorted(learner.policy.tokenizer.eos_token_ids))
    )
    results = []
    for item, samples in zip(lease_msg.prompts, groups):
        wire = [
            m.Completion(
                tokens=m.Tensor.from_numpy(np.asarray(c.tokens, dtype=np.int32)),
                logprobs=m.Tensor.from_numpy(np.asarray(c.logprobs, dtype=np.float32)),
                reward=INFORMATIVE[i],
                finish_reason="stop" if c.finish_reason == "stop" else "length",
            )
            for i, c in enumerate(samples)
        ]
        results.append(m.GroupResult(group_id=item.group_id, completions=wire))
    return m.Rollouts(lease_id=lease_msg.lease_id, policy_version=lease_msg.policy_version,
                      incarnation=learner.state.incarnation, groups=results)


def ledger(learner: RunCoordinator, events: bool = False) -> list[dict]:
    """The ledger's acceptance lines (with `events`, its drop and unchecked lines too)."""
    path = learner.run_dir / "ledger.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines if events else [line for line in lines if "event" not in line]


def metrics_lines(learner: RunCoordinator) -> list[dict]:
    path = learner.run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sample(learner: RunCoordinator, name: str, labels: Optional[dict] = None) -> float:
    value = learner.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def rejections(learner: RunCoordinator, reason: str) -> float:
    return sample(learner, "grpo_fleet_learner_rejections_total", {"reason": reason})


def fill_buffer(learner: RunCoordinator, identity: bytes = ACTOR_A) -> m.Lease:
    lease_msg = lease(learner, identity)
    ack = ask(learner, identity, rollouts_for(lease_msg, incarnation=learner.state.incarnation))
    assert ack.status == "accepted"
    return lease_msg


# ----------------------------------------------------------------- registration


def test_hello_gets_a_welcome_describing_the_run(learner, tiny_model_dir):
    welcome = hello(learner, actor_id="worker-7")
    assert welcome.actor_id == "worker-7"
    assert welcome.run_id == learner.state.run_id
    assert welcome.generation == m.GenerationParams(group_size=GROUP_SIZE, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0)
    assert welcome.reward.names == ["reverse_positions"]
    assert welcome.reward.weights == [1.0]
    assert welcome.vocab_size == learner.policy.vocab_size
    assert welcome.model.path == str(tiny_model_dir)
    assert welcome.model.digest == model_digest(str(tiny_model_dir))
    assert welcome.model.lora is None
    assert welcome.model.chat_template is False
    assert welcome.policy_version == 0
    assert sample(learner, "grpo_fleet_learner_actors_connected") == 1


def test_welcome_carries_lora_settings_when_training_adapters(make_learner):
    learner = make_learner(lora={"enabled": True, "rank": 4})
    welcome = hello(learner)
    assert welcome.model.lora is not None
    assert welcome.model.lora["enabled"] is True and welcome.model.lora["rank"] == 4


@pytest.mark.parametrize(
    "request_msg",
    [m.LeaseRequest(max_groups=1), m.GetWeights(version=0), m.Heartbeat(),
     m.Rollouts(lease_id="x", policy_version=0, groups=[crafted_group("g", INFORMATIVE)])],
    ids=["lease", "weights", "heartbeat", "rollouts"],
)
def test_requests_before_hello_are_refused(learner, request_msg):
    reply = ask(learner, ACTOR_A, request_msg)
    assert isinstance(reply, m.ErrorReply)
    assert reply.reason == "not_registered"
    assert sample(learner, "grpo_fleet_learner_protocol_errors_total", {"reason": "not_registered"}) == 1
    assert learner.state.scheduler.outstanding_groups == 0
    assert ledger(learner) == []


OBSERVER = b"observer-identity"
OBSERVER_KEY = "observer-curve-public-key"


def test_an_observer_key_may_ask_status_and_nothing_else(learner):
    """`keys add-observer`: Hello, leases, rollouts and weights are refused and counted; Status is answered."""
    hello(learner)
    actor_lease = lease(learner)  # a real actor's lease the observer tries to fill
    refused = [
        m.Hello(actor_id="peeker", host="h", backend="cpu", versions={}),
        m.LeaseRequest(max_groups=1),
        m.Rollouts(lease_id=actor_lease.lease_id, policy_version=0, incarnation=learner.state.incarnation,
                   groups=[crafted_group(p.group_id, INFORMATIVE) for p in actor_lease.prompts]),
        m.GetWeights(version=0),
    ]
    for request_msg in refused:
        reply = ask(learner, OBSERVER, request_msg, principal=OBSERVER_KEY, observer=True)
        assert isinstance(reply, m.ErrorReply), type(request_msg).__name__
        assert reply.reason == "forbidden"
    assert sample(learner, "grpo_fleet_learner_auth_failures_total", {"reason": "observer"}) == len(refused)
    assert [info.principal for info in learner.registry.actors.values()] == [ACTOR_A.hex()]
    assert ledger(learner) == [] and learner.state.buffer == []
    assert isinstance(ask(learner, OBSERVER, m.StatusRequest(), principal=OBSERVER_KEY, observer=True), m.Status)
    # The same requests from an actor key are answered as ever.
    assert ask(learner, ACTOR_A, rollouts_for(actor_lease, incarnation=learner.state.incarnation)).status == "accepted"


def test_registration_is_per_identity(learner):
    hello(learner, ACTOR_A)
    reply = ask(learner, ACTOR_B, m.LeaseRequest(max_groups=1))
    assert isinstance(reply, m.ErrorReply) and reply.reason == "not_registered"


def test_heartbeat_and_weights_after_hello(learner):
    hello(learner)
    beat = ask(learner, ACTOR_A, m.Heartbeat(actor_id="actor-a"))
    assert isinstance(beat, m.Heartbeat) and beat.policy_version == 0
    reply = learner.handle(ACTOR_A, m.GetWeights(version=0, offset=0, length=100))
    header, raw = reply.message, reply.raw
    assert isinstance(header, m.WeightsChunk)
    assert (header.version, header.offset, header.length) == (0, 0, 100)
    assert header.digest == learner.snapshots.current.digest == m.blob_digest(learner.snapshots.current.blob)
    assert header.total_bytes == len(learner.snapshots.current.blob)
    assert bytes(raw) == learner.snapshots.current.blob[:100]
    # Counted once the chunk is handed to ZeroMQ, not when the reply is built (test_weights_in_flight counts it).
    assert sample(learner, "grpo_fleet_learner_weight_sent_bytes_total") == 0


def test_a_reply_type_sent_as_a_request_is_an_error(learner):
    hello(learner)
    reply = ask(learner, ACTOR_A, m.Ack(lease_id="L1", status="accepted"))
    assert isinstance(reply, m.ErrorReply)
    assert reply.reason == "unexpected_type"


# ----------------------------------------------------------------- leases


def test_lease_prompts_are_the_tokenized_training_prompts(learner):
    hello(learner)
    lease_msg = lease(learner, max_groups=3)
    assert lease_msg.lease_id
    assert lease_msg.policy_version == 0
    assert lease_msg.deadline_seconds == learner.cfg.server.lease_seconds
    assert len(lease_msg.prompts) == 3
    assert len({p.group_id for p in lease_msg.prompts}) == 3
    for item in lease_msg.prompts:
        np.testing.assert_array_equal(item.prompt_tokens.to_numpy(), learner.prompt_tokens[item.prompt_index])
        example = learner.task.train[item.prompt_index]
        assert item.fields == {"answer": example.answer}
        assert learner.policy.tokenizer.decode(item.prompt_tokens.to_numpy().tolist()) == example.prompt
    assert learner.state.scheduler.outstanding_groups == 3
    assert sample(learner, "grpo_fleet_learner_leases_issued_total") == 1


def test_lease_size_is_capped_by_max_groups_per_lease(make_learner):
    learner = make_learner(server={"max_groups_per_lease": 1})
    hello(learner)
    assert len(lease(learner, max_groups=4).prompts) == 1


def test_in_flight_groups_are_capped_at_twice_groups_per_step(learner):
    hello(learner)
    hello(learner, ACTOR_B, "actor-b")
    capacity = 2 * GROUPS_PER_STEP
    first = lease(learner, max_groups=3)
    second = lease(learner, ACTOR_B, max_groups=3)
    assert len(first.prompts) + len(second.prompts) == capacity
    assert len(second.prompts) == capacity - 3
    empty = lease(learner, max_groups=1)
    assert empty.lease_id == "" and empty.prompts == [] and empty.retry_after > 0
    assert learner.state.scheduler.outstanding_groups == capacity

    # Buffered (accepted, not yet trained) groups count against the cap too.
    assert ask(learner, ACTOR_A, rollouts_for(first)).status == "accepted"
    assert len(learner.state.buffer) == 3
    assert learner.state.scheduler.outstanding_groups == 1
    assert lease(learner, max_groups=4).prompts == []


def test_leases_are_sized_to_each_actors_measured_speed(make_learner, clock):
    """A fast actor gets more groups than a slow one once both returned a lease."""
    learner = make_learner(grpo={"groups_per_step": 32}, server={"max_groups_per_lease": 16, "lease_target_seconds": 4.0})
    learner.state.scheduler.clock = clock
    hello(learner)
    hello(learner, ACTOR_B, "actor-b")
    fast, slow = lease(learner, max_groups=2), lease(learner, ACTOR_B, max_groups=2)
    assert len(fast.prompts) == len(slow.prompts) == 2  # unmeasured: what they asked for
    clock.advance(0.5)
    assert ask(learner, ACTOR_A, rollouts_for(fast)).status == "accepted"  # 4 groups/s
    clock.advance(1.5)
    assert ask(learner, ACTOR_B, rollouts_for(slow)).status == "accepted"  # 1 group/s
    # 4 s at 4 groups/s, capped at 16; 4 s at 1 group/s.
    assert len(lease(learner, max_groups=16).prompts) == 16
    assert len(lease(learner, ACTOR_B, max_groups=16).prompts) == 4
    assert sample(learner, "grpo_fleet_learner_lease_groups_count") == 4


def test_a_prefetched_lease_is_timed_from_the_previous_return(make_learner, clock):
    """Actors ask for lease n+1 before generating lease n; its wait in hand is not generation time."""
    learner = make_learner(grpo={"groups_per_step": 32}, server={"max_groups_per_lease": 16})
    learner.state.scheduler.clock = clock
    hello(learner)
    current, prefetched = lease(learner, max_groups=2), lease(learner, max_groups=2)
    clock.advance(1.0)
    assert ask(learner, ACTOR_A, rollouts_for(current)).status == "accepted"
    clock.advance(1.0)
    assert ask(learner, ACTOR_A, rollouts_for(prefetched)).status == "accepted"
    assert learner.registry.actors[ACTOR_A].groups_per_second.value == pytest.approx(2.0)


def test_refused_lease_retries_about_half_a_step_later(learner):
    hello(learner)
    lease(learner, max_groups=2 * GROUPS_PER_STEP)
    assert lease(learner).retry_after == 0.2  # no step yet: the slow default
    learner.leasing.step_interval.add(0.04)
    assert lease(learner).retry_after == pytest.approx(0.02)


def test_no_leases_once_training_is_done(make_learner):
    learner = make_learner(train={"steps": 1})
    hello(learner)
    fill_buffer(learner)
    learner.train_step()
    assert learner.state.done
    assert lease(learner).prompts == []


def test_expired_leases_are_requeued_and_a_late_result_still_counts_once(learner):
    """Issue 38: long answers outlived their leases, and every late result was refused as stale_lease."""
    hello(learner)
    lease_msg = lease(learner)
    ids = [p.group_id for p in lease_msg.prompts]
    assert learner.expire_leases() == 0
    later = time.monotonic() + learner.cfg.server.lease_seconds + 1
    learner.state.scheduler.clock = lambda: later
    assert learner.expire_leases() == 0, "its actor is still connected: extended, not re-queued"
    assert sample(learner, "grpo_fleet_learner_leases_extended_total", {"kind": "train"}) == 1
    later += 2 * learner.cfg.server.lease_seconds  # past server.max_lease_seconds (3 x lease_seconds)
    assert learner.expire_leases() == 1
    assert learner.state.scheduler.outstanding_groups == 0
    assert sample(learner, "grpo_fleet_learner_leases_expired_total") == 1
    assert [t.group_id for t in learner.state.scheduler.queue.tickets] == ids, "re-queued for anyone meanwhile"

    ack = ask(learner, ACTOR_A, rollouts_for(lease_msg))
    assert ack.status == "accepted" and ack.groups == dict.fromkeys(ids, "accepted")
    assert rejections(learner, RejectReason.STALE_LEASE) == 0
    assert sample(learner, "grpo_fleet_learner_late_groups_total", {"kind": "train"}) == len(ids)
    assert [line["group_id"] for line in ledger(learner)] == ids
    # Taken out of the queue: the next lease holds fresh groups.
    hello(learner, ACTOR_B, "actor-b")
    assert not set(ids) & {p.group_id for p in lease(learner, ACTOR_B).prompts}


def test_a_connected_actors_lease_is_extended_a_dropped_ones_result_still_counts(learner):
    hello(learner)
    lease_msg = lease(learner)
    later = time.monotonic() + learner.cfg.server.lease_seconds + 1
    learner.state.scheduler.clock = lambda: later
    assert learner.expire_leases() == 0 and learner.state.scheduler.outstanding_groups == len(lease_msg.prompts)
    assert learner.drop_actor(ACTOR_A) == 1, "went silent: its lease goes back"
    assert learner.state.scheduler.outstanding_groups == 0
    hello(learner)  # it comes back, and sends what it finished meanwhile
    ack = ask(learner, ACTOR_A, rollouts_for(lease_msg))
    assert ack.status == "accepted" and len(ledger(learner)) == len(lease_msg.prompts)


def test_a_late_eval_result_is_kept_never_judged_as_training(make_learner):
    """Issue 38: an expired eval lease's result went to intake and was refused as bad_group_size, a violation."""
    learner = make_learner(train={"eval_every": 1})
    hello(learner)
    eval_lease = lease(learner)
    assert eval_lease.eval is not None and eval_lease.eval.samples == 1 != GROUP_SIZE
    later = time.monotonic() + 3 * learner.cfg.server.lease_seconds + 1  # past server.max_lease_seconds
    learner.evaluation.clock = lambda: later
    learner.expire_leases()
    assert not learner.evaluation.current.leases
    late = rollouts_for(eval_lease, rewards=[1.0])
    ack = ask(learner, ACTOR_A, late)
    assert ack.status == "accepted" and set(ack.groups.values()) == {"eval"}
    assert sample(learner, "grpo_fleet_learner_late_groups_total", {"kind": "eval"}) == len(eval_lease.prompts)
    assert rejections(learner, RejectReason.BAD_GROUP_SIZE) == 0 and ledger(learner) == []
    while (rest := lease(learner)).eval is not None:  # the rest of the round
        assert ask(learner, ACTOR_A, rollouts_for(rest, rewards=[0.0])).status == "accepted"
    assert learner.evaluation.current is None and learner.evaluation.finished[0][1].eval_reward == pytest.approx(
        len(eval_lease.prompts) / 8)
    # The same result again, after its round: stale, not a violation (eval answers are not stored).
    again = ask(learner, ACTOR_A, late)
    assert (again.status, again.reason) == ("stale", RejectReason.EVAL_ROUND_DONE)
    assert learner.registry.bans.violations(learner.registry.actors[ACTOR_A].principal) == 0


# ----------------------------------------------------------------- rollouts


def test_accepted_rollouts_are_acked_and_ledgered(learner):
    hello(learner, actor_id="actor-a")
    lease_msg = lease(learner)
    ack = ask(learner, ACTOR_A, rollouts_for(lease_msg))
    assert ack.status == "accepted"
    assert ack.groups == {p.group_id: "accepted" for p in lease_msg.prompts}

    lines = ledger(learner)
    assert len(lines) == len(lease_msg.prompts)
    for line, item in zip(lines, lease_msg.prompts):
        assert line == {
            "group_id": item.group_id, "prompt_index": item.prompt_index, "actor_id": "actor-a",
            "actor_key": ACTOR_A.hex(), "policy_version": 0, "step": 0, "zero_variance": False,
        }
    assert len(learner.state.buffer) == len(lease_msg.prompts)
    assert learner.state.scheduler.outstanding_groups == 0
    assert learner.state.scheduler.finished == {p.group_id for p in lease_msg.prompts}
    assert sample(learner, "grpo_fleet_learner_groups_accepted_total") == len(lease_msg.prompts)
    assert sample(learner, "grpo_fleet_learner_tokens_accepted_total") == len(lease_msg.prompts) * GROUP_SIZE * 3

    stored = learner.state.buffer[0]
    np.testing.assert_array_equal(stored.prompt_tokens, learner.prompt_tokens[lease_msg.prompts[0].prompt_index])
    np.testing.assert_allclose(stored.rewards, INFORMATIVE)


def test_a_replayed_rollouts_gets_the_stored_ack_and_changes_nothing(learner):
    hello(learner)
    lease_msg = lease(learner)
    msg = rollouts_for(lease_msg)
    first = ask(learner, ACTOR_A, msg)
    lines, buffered = ledger(learner), len(learner.state.buffer)

    again = ask(learner, ACTOR_A, msg)
    assert again == first
    assert ledger(learner) == lines
    assert len(learner.state.buffer) == buffered
    assert sample(learner, "grpo_fleet_learner_groups_accepted_total") == len(lease_msg.prompts)


def test_a_finished_group_resubmitted_under_another_lease_is_a_duplicate(learner):
    hello(learner)
    done = lease(learner, max_groups=1)
    ask(learner, ACTOR_A, rollouts_for(done))
    other = lease(learner, max_groups=1)
    forged = m.Rollouts(
        lease_id=other.lease_id, policy_version=0,
        groups=[crafted_group(done.prompts[0].group_id, INFORMATIVE), crafted_group(other.prompts[0].group_id, INFORMATIVE)],
    )
    ack = ask(learner, ACTOR_A, forged)
    assert ack.groups == {done.prompts[0].group_id: "duplicate", other.prompts[0].group_id: "accepted"}
    assert ack.status == "accepted"
    assert rejections(learner, RejectReason.DUPLICATE) == 1
    assert [line["group_id"] for line in ledger(learner)].count(done.prompts[0].group_id) == 1


def _wrong_group_size(learner, lease_msg, other):
    return rollouts_for(lease_msg, INFORMATIVE[:3])


def _token_out_of_range(learner, lease_msg, other):
    return rollouts_for(lease_msg, token=learner.policy.vocab_size - 1)  # token + i % 3 reaches past the vocab


def _positive_logprob(learner, lease_msg, other):
    return rollouts_for(lease_msg, logprob=0.5)


def _too_long(learner, lease_msg, other):
    return rollouts_for(lease_msg, length=MAX_TOKENS + 1)


def _reward_beyond_bound(learner, lease_msg, other):
    # Within float32 (1e39 is refused at decoding already) but past task.reward_bound.
    return rollouts_for(lease_msg, [0.0, 1.0, 2.0, 2 * learner.cfg.task.reward_bound])


def _logprob_below_floor(learner, lease_msg, other):
    return rollouts_for(lease_msg, logprob=-3e38)


def _group_not_in_lease(learner, lease_msg, other):
    groups = [crafted_group(p.group_id, INFORMATIVE) for p in lease_msg.prompts + other.prompts]
    return m.Rollouts(lease_id=lease_msg.lease_id, policy_version=0, groups=groups)


def _duplicate_group_in_message(learner, lease_msg, other):
    gid = lease_msg.prompts[0].group_id
    return m.Rollouts(lease_id=lease_msg.lease_id, policy_version=0,
                      groups=[crafted_group(gid, INFORMATIVE), crafted_group(gid, INFORMATIVE)])


INVALID_CASES = [
    (_wrong_group_size, RejectReason.BAD_GROUP_SIZE, ACTOR_A),
    (_token_out_of_range, RejectReason.TOKEN_OUT_OF_RANGE, ACTOR_A),
    (_positive_logprob, RejectReason.BAD_LOGPROB, ACTOR_A),
    (_too_long, RejectReason.TOO_LONG, ACTOR_A),
    (_reward_beyond_bound, RejectReason.BAD_REWARD, ACTOR_A),
    (_logprob_below_floor, RejectReason.BAD_LOGPROB, ACTOR_A),
    (_group_not_in_lease, RejectReason.NOT_LEASED, ACTOR_A),
    (_duplicate_group_in_message, RejectReason.DUPLICATE_GROUP_IN_MESSAGE, ACTOR_A),
    (lambda learner, lease_msg, other: rollouts_for(lease_msg), RejectReason.NOT_YOUR_LEASE, ACTOR_B),
]


@pytest.mark.parametrize(("build", "reason", "sender"), INVALID_CASES, ids=[c[1].value for c in INVALID_CASES])
def test_invalid_rollouts_are_rejected_without_changing_state(learner, build, reason, sender):
    hello(learner, ACTOR_A, "actor-a")
    hello(learner, ACTOR_B, "actor-b")
    lease_msg = lease(learner, ACTOR_A, max_groups=1)
    other = lease(learner, ACTOR_A, max_groups=1)
    outstanding = learner.state.scheduler.outstanding_groups
    leases_before = set(learner.state.scheduler.ledger.leases)

    ack = ask(learner, sender, build(learner, lease_msg, other))

    assert isinstance(ack, m.Ack)
    assert ack.status == "invalid"
    assert ack.reason == reason
    assert rejections(learner, reason) == 1
    assert ledger(learner) == []
    assert learner.state.buffer == []
    assert learner.state.scheduler.outstanding_groups == outstanding
    assert set(learner.state.scheduler.ledger.leases) == leases_before
    assert learner.state.scheduler.finished == set()
    assert learner.state.step == 0 and learner.state.version == 0
    assert learner.registry.bans.violations(learner.registry.actors[sender].principal) == 1, "hostile input counts toward a ban"
    # An invalid answer is not remembered: the rightful holder can still submit a good result.
    good = ask(learner, ACTOR_A, rollouts_for(lease_msg))
    assert good.status == "accepted"


def test_zero_variance_group_is_ledgered_but_not_trained_on(learner):
    hello(learner)
    lease_msg = lease(learner)
    flat_id = lease_msg.prompts[0].group_id
    msg = m.Rollouts(
        lease_id=lease_msg.lease_id, policy_version=0,
        groups=[crafted_group(flat_id, FLAT), crafted_group(lease_msg.prompts[1].group_id, INFORMATIVE)],
    )
    ack = ask(learner, ACTOR_A, msg)
    assert ack.status == "accepted"
    assert ack.groups[flat_id] == "accepted"
    assert [line["group_id"] for line in ledger(learner)] == [p.group_id for p in lease_msg.prompts]
    assert [g.group_id for g in learner.state.buffer] == [lease_msg.prompts[1].group_id]
    assert sample(learner, "grpo_fleet_learner_groups_zero_variance_total") == 1
    assert learner.state.zero_variance_since_step == 1
    assert not learner.ready_to_train()
    # The flat group is finished for good, not re-queued.
    assert flat_id in learner.state.scheduler.finished


def test_results_too_far_behind_are_stale_and_requeued(learner):
    hello(learner)
    lease_msg = lease(learner)
    ids = [p.group_id for p in lease_msg.prompts]
    indices = [p.prompt_index for p in lease_msg.prompts]
    learner.state.version = learner.cfg.grpo.max_staleness + 1

    ack = ask(learner, ACTOR_A, rollouts_for(lease_msg, version=0))
    assert ack.status == "stale"
    assert ack.reason == RejectReason.STALE_VERSION
    assert ack.groups == {gid: "stale" for gid in ids}
    assert rejections(learner, RejectReason.STALE_VERSION) == len(ids)
    assert ledger(learner) == [] and learner.state.buffer == []
    assert learner.state.scheduler.outstanding_groups == 0
    assert [t.group_id for t in learner.state.scheduler.queue.tickets] == ids

    again = lease(learner)
    assert [p.group_id for p in again.prompts] == ids
    assert [p.prompt_index for p in again.prompts] == indices
    assert again.policy_version == learner.state.version


def test_results_within_max_staleness_are_accepted(learner):
    hello(learner)
    lease_msg = lease(learner)
    learner.state.version = learner.cfg.grpo.max_staleness
    ack = ask(learner, ACTOR_A, rollouts_for(lease_msg, version=0))
    assert ack.status == "accepted"
    assert {line["policy_version"] for line in ledger(learner)} == {0}


# ----------------------------------------------------------------- training


def test_train_step_records_metrics_publishes_and_checkpoints(learner):
    hello(learner)
    lease_msg = lease(learner)
    assert not learner.ready_to_train()
    assert ask(learner, ACTOR_A, generated_rollouts(learner, lease_msg)).status == "accepted"
    assert learner.ready_to_train()
    digest_before = learner.snapshots.current.digest
    expected_tokens = sum(g.num_tokens for g in learner.state.buffer)

    record = learner.train_step()

    assert learner.state.step == 1
    assert learner.state.version == 1
    assert record.policy_version == 1, "this step published a new version"
    assert learner.snapshots.current.version == 1
    assert learner.snapshots.current.digest != digest_before
    reply = learner.handle(ACTOR_A, m.GetWeights(version=1, length=10**9))
    header, raw = reply.message, reply.raw
    assert header.version == 1 and header.digest == learner.snapshots.current.digest == m.blob_digest(bytes(raw))
    old_header = ask(learner, ACTOR_A, m.GetWeights(version=0))
    assert old_header.version == 0, "the previous version stays available to finish a transfer"
    assert learner.state.buffer == []
    assert not learner.ready_to_train()

    lines = metrics_lines(learner)
    assert len(lines) == 1
    line = lines[0]
    assert STEP_RECORD_KEYS <= line.keys()
    assert line["step"] == 1 and line["policy_version"] == 1
    assert line["groups"] == GROUPS_PER_STEP
    assert line["tokens"] == expected_tokens
    assert line["reward_mean"] == pytest.approx(np.mean(INFORMATIVE))
    assert 0.0 <= line["clip_fraction"] <= 1.0
    assert line["kl"] >= 0.0
    assert np.isfinite(line["loss"]) and line["step_seconds"] > 0
    assert line["skipped"] is None and line["peak_memory_bytes"] > 0
    assert 0.0 <= line["staleness_mean"] <= 1.0
    assert sample(learner, "grpo_fleet_learner_steps_total") == 1
    assert sample(learner, "grpo_fleet_learner_policy_version") == 1
    assert sample(learner, "grpo_fleet_learner_peak_memory_bytes") == line["peak_memory_bytes"]

    checkpoint = learner.run_dir / "checkpoints" / "step_000001"
    assert (checkpoint / "optimizer.safetensors").is_file()
    meta = json.loads((checkpoint / "grpo_fleet.json").read_text())
    assert meta["step"] == 1 and meta["policy_version"] == 1 and meta["run_id"] == learner.state.run_id
    latest = json.loads((learner.run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["path"] == "step_000001"
    model, tokenizer = mlx_lm.load(str(checkpoint))
    text = mlx_lm.generate(model, tokenizer, "12=", max_tokens=3)
    assert isinstance(text, str)


def test_train_step_uses_the_oldest_groups_first(learner):
    hello(learner)
    lease_msg = lease(learner, max_groups=4)
    ask(learner, ACTOR_A, rollouts_for(lease_msg))
    oldest = [g.group_id for g in learner.state.buffer[:GROUPS_PER_STEP]]
    newest = [g.group_id for g in learner.state.buffer[GROUPS_PER_STEP:]]
    learner.train_step()
    assert [g.group_id for g in learner.state.buffer] == newest
    assert oldest == [p.group_id for p in lease_msg.prompts[:GROUPS_PER_STEP]]
    assert learner.ready_to_train()


def test_ledger_lines_carry_the_step_they_were_accepted_in(learner):
    hello(learner)
    fill_buffer(learner)
    learner.train_step()
    fill_buffer(learner)
    assert [line["step"] for line in ledger(learner)] == [0] * GROUPS_PER_STEP + [1] * GROUPS_PER_STEP
    assert [line["policy_version"] for line in ledger(learner)] == [0] * GROUPS_PER_STEP + [1] * GROUPS_PER_STEP


def test_version_bumps_every_sync_every_steps(make_learner):
    learner = make_learner(train={"steps": 3, "sync_every": 2, "checkpoint_every": 10})
    hello(learner)
    digest0 = learner.snapshots.current.digest
    fill_buffer(learner)
    first = learner.train_step()
    assert (learner.state.step, learner.state.version, first.policy_version) == (1, 0, 0)
    assert learner.snapshots.current.digest == digest0  # nothing new published yet
    fill_buffer(learner)
    second = learner.train_step()
    assert (learner.state.step, learner.state.version, second.policy_version) == (2, 1, 1)
    assert learner.snapshots.current.digest != digest0
    assert [line["policy_version"] for line in metrics_lines(learner)] == [0, 1]
    # checkpoint_every=10 > steps so far: no checkpoint yet...
    assert not (learner.run_dir / "checkpoints").exists()
    fill_buffer(learner)
    learner.train_step()
    # ...but the final step always writes one.
    assert learner.state.done
    assert (learner.run_dir / "checkpoints" / "step_000003").is_dir()
    assert not learner.ready_to_train()


def test_zero_variance_fraction_is_reported_and_reset_per_step(learner):
    hello(learner)
    lease_msg = lease(learner, max_groups=4)
    rewards = {0: FLAT, 1: INFORMATIVE, 2: INFORMATIVE, 3: FLAT}
    msg = m.Rollouts(
        lease_id=lease_msg.lease_id, policy_version=0,
        groups=[crafted_group(p.group_id, rewards[i]) for i, p in enumerate(lease_msg.prompts)],
    )
    ask(learner, ACTOR_A, msg)
    record = learner.train_step()
    assert record.zero_variance_fraction == pytest.approx(0.5)
    assert learner.state.accepted_since_step == 0 and learner.state.zero_variance_since_step == 0


# ----------------------------------------------------------------- resume


def test_resume_restores_state_and_cuts_logs_back_to_the_checkpoint(tiny_model_dir, tmp_path):
    cfg = run_config(tiny_model_dir, tmp_path / "run", train={"steps": 5, "checkpoint_every": 1})
    first = build_learner(cfg)
    hello(first)
    granted = lease(first)
    ask(first, ACTOR_A, generated_rollouts(first, granted))
    first.train_step()  # checkpoint at step 1 (buffer empty, nothing outstanding)
    outstanding = lease(first)  # leased after the checkpoint...
    ask(first, ACTOR_A, rollouts_for(outstanding, FLAT, incarnation=first.state.incarnation))  # ...and accepted after it
    kept = ledger(first)[: GROUPS_PER_STEP]
    assert len(ledger(first)) == 2 * GROUPS_PER_STEP
    first.close()

    second = build_learner(cfg, resume=True)
    try:
        assert (second.state.step, second.state.version, second.state.run_id) == (1, 1, first.state.run_id)
        assert ledger(second) == kept, "groups accepted after the checkpoint leave the ledger"
        assert len(metrics_lines(second)) == 1
        assert second.state.scheduler.finished == {entry["group_id"] for entry in kept}
        # the post-checkpoint lease is unknown to the resumed learner: a late submission is stale
        hello(second)
        late = ask(second, ACTOR_A, rollouts_for(outstanding, INFORMATIVE))
        assert late.status == "stale" and set(late.groups.values()) == {"stale"}
        # the same prompts are handed out again under the same group ids
        again = lease(second)
        assert [p.prompt_index for p in again.prompts] == [p.prompt_index for p in outstanding.prompts]
        assert [p.group_id for p in again.prompts] == [p.group_id for p in outstanding.prompts]
    finally:
        second.close()


def test_weights_saved_between_publications_resume_as_a_version_of_their_own(tiny_model_dir, tmp_path):
    """train.sync_every = 2 and a checkpoint after step 1: the saved weights are past v0, which the previous
    life's actors still hold. Resumed as v0 they would be other weights under the same number: an honest group
    sampled from the real v0 then fails the logprob check (a chaos run banned an honest actor for this)."""
    cfg = run_config(tiny_model_dir, tmp_path / "run", train={"steps": 9, "checkpoint_every": 1, "sync_every": 2})
    first = build_learner(cfg)
    hello(first)
    published_v0 = first.snapshots.current
    fill_buffer(first)
    first.train_step()  # step 1 trains but does not publish: checkpoint with weights past v0
    assert (first.state.step, first.state.version, first.state.weights_published) == (1, 0, False)
    first.close()

    second = build_learner(cfg, resume=True)
    try:
        assert (second.state.version, second.state.history_version) == (1, 0)
        assert second.snapshots.current.version == 1 and second.snapshots.current.digest != published_v0.digest
        assert hello(second).policy_version == 1, "actors holding v0 fetch the new weights"
    finally:
        second.close()


def test_resumed_learner_judges_work_by_incarnation_and_shared_history(tiny_model_dir, tmp_path):
    cfg = run_config(tiny_model_dir, tmp_path / "run", train={"steps": 9, "checkpoint_every": 2})
    first = build_learner(cfg)
    old = hello(first)
    for _ in range(3):  # steps 1-3: checkpoint at step 2 (v2), the previous life goes on to v3
        fill_buffer(first)
        first.train_step()
    assert first.state.version == 3
    held = lease(first, max_groups=1)  # leased at v3, after the checkpoint: the resumed life never issued it
    first.close()

    second = build_learner(cfg, resume=True)
    try:
        assert (second.state.version, second.state.history_version) == (2, 2)
        welcome = hello(second)
        assert welcome.incarnation != old.incarnation and welcome.policy_version == 2
        # v3 of the previous life: a version this life has not published
        late = held.model_copy(update={"policy_version": 3})
        ack = ask(second, ACTOR_A, rollouts_for(late).model_copy(update={"incarnation": old.incarnation}))
        assert ack.status == "stale"
        # once this life publishes its own v3, the previous life's v3 still names other weights
        fill_buffer(second)
        second.train_step()
        assert second.state.version == 3
        fresh = lease(second, max_groups=1)
        other_life = rollouts_for(fresh, version=3).model_copy(update={"incarnation": old.incarnation})
        assert ask(second, ACTOR_A, other_life).reason == RejectReason.PREVIOUS_INCARNATION
        # v2 is shared history: sampled before the checkpoint, so good in either life
        shared = rollouts_for(lease(second, max_groups=1), version=2).model_copy(update={"incarnation": old.incarnation})
        assert ask(second, ACTOR_A, shared).status == "accepted"
        assert second.registry.bans.violations(ACTOR_A.hex()) == 0
    finally:
        second.close()


def test_hello_requeues_the_leases_an_actor_no_longer_holds(learner):
    hello(learner)
    kept, lost = lease(learner, max_groups=1), lease(learner, max_groups=1)
    # the actor reconnects (or restarts) and names only the lease it will still deliver
    reply = ask(learner, ACTOR_A, m.Hello(actor_id="actor-a", host="h", backend="cpu", versions={},
                                            holding=[kept.lease_id]))
    assert isinstance(reply, m.Welcome)
    assert set(learner.state.scheduler.ledger.leases) == {kept.lease_id}
    assert [t.group_id for t in learner.state.scheduler.queue.tickets] == [p.group_id for p in lost.prompts]


def test_resume_keeps_buffered_groups_and_open_leases(tiny_model_dir, tmp_path):
    cfg = run_config(tiny_model_dir, tmp_path / "run", grpo={"groups_per_step": 4}, train={"steps": 5})
    first = build_learner(cfg)
    hello(first)
    buffered = lease(first, max_groups=2)
    ask(first, ACTOR_A, rollouts_for(buffered))
    still_out = lease(first, max_groups=2)
    first.checkpoint()
    first.close()

    second = build_learner(cfg, resume=True)
    try:
        assert [g.group_id for g in second.state.buffer] == [p.group_id for p in buffered.prompts]
        ask(second, ACTOR_A, m.Hello(actor_id="actor-a", host="h", backend="cpu", versions={},
                                       holding=[still_out.lease_id]))
        ack = ask(second, ACTOR_A, rollouts_for(still_out))
        assert ack.status == "accepted", "an actor's lease survives the learner restart"
        assert second.ready_to_train()
    finally:
        second.close()


def test_fresh_start_refuses_a_run_dir_holding_a_run(tiny_model_dir, tmp_path):
    from grpo_fleet.learner.run.build import RunDirInUse

    cfg = run_config(tiny_model_dir, tmp_path / "run")
    first = build_learner(cfg)
    hello(first)
    ask(first, ACTOR_A, rollouts_for(lease(first)))
    first.close()
    with pytest.raises(RunDirInUse, match="--resume"):
        build_learner(cfg)


def test_peer_sending_garbage_is_cut_off(make_learner):
    learner = make_learner(server={"max_violations": 3})
    hello(learner, b"pest", "pest")
    for _ in range(3):
        assert isinstance(ask(learner, b"pest", m.Welcome.model_construct()), m.ErrorReply)
    assert learner.registry.is_banned(b"pest".hex())
    assert not learner.registry.is_banned(ACTOR_A.hex())
    assert sample(learner, "grpo_fleet_learner_bans_total") == 1


def test_requests_before_hello_are_refused_but_never_ban(make_learner):
    # What every honest actor sends a restarted learner before its next Hello.
    learner = make_learner(server={"max_violations": 2})
    for _ in range(5):
        reply = ask(learner, ACTOR_A, m.LeaseRequest(max_groups=1))
        assert isinstance(reply, m.ErrorReply) and reply.reason == "not_registered"
    assert not learner.registry.is_banned(ACTOR_A.hex())
    assert sample(learner, "grpo_fleet_learner_protocol_errors_total", {"reason": "not_registered"}) == 5


def test_rollouts_from_a_version_never_published_are_stale_not_violations(make_learner):
    # An actor still holding what a learner published before it died and resumed.
    learner = make_learner(server={"max_violations": 2})
    welcome = hello(learner)
    for _ in range(4):
        granted = lease(learner, max_groups=1)
        msg = rollouts_for(granted, version=learner.state.version + 7).model_copy(update={"incarnation": welcome.incarnation})
        ack = ask(learner, ACTOR_A, msg)
        assert ack.status == "stale" and ack.reason == RejectReason.UNPUBLISHED_VERSION
    assert not learner.registry.is_banned(ACTOR_A.hex()) and learner.registry.bans.violations(ACTOR_A.hex()) == 0
    assert learner.state.scheduler.outstanding_groups == 0, "the groups went back to the queue"
    assert ledger(learner) == []


def _in_a_thread(call: Callable[[], object], timeout: float = 10.0) -> object:
    """`call()` on another thread; fails (instead of hanging) if it cannot finish, e.g. for want of the lock."""
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(call()), daemon=True)
    worker.start()
    worker.join(timeout)
    assert results, f"no answer within {timeout}s: the learner's lock is held"
    return results[0]


def test_requests_are_answered_while_a_step_writes_its_checkpoint(make_learner, monkeypatch):
    """The step's checkpoint copies the state under the lock and writes it outside, so the ROUTER loop never stalls."""
    from grpo_fleet.learner.records import persistence

    learner = make_learner(train={"steps": 5, "checkpoint_every": 1})
    hello(learner)
    fill_buffer(learner)
    writing, release = threading.Event(), threading.Event()
    write_state = persistence.write_state

    def blocked_write(directory, data):
        writing.set()
        assert release.wait(60), "the test never let the writer go on"
        return write_state(directory, data)

    monkeypatch.setattr(persistence, "write_state", blocked_write)
    training = threading.Thread(target=learner.train_step, daemon=True)
    training.start()
    try:
        assert writing.wait(120), "the step never reached its checkpoint"
        # The training thread is stuck inside the write; every kind of request is still answered.
        assert isinstance(_in_a_thread(lambda: ask(learner, ACTOR_A, m.Heartbeat())), m.Heartbeat)
        assert isinstance(_in_a_thread(lambda: ask(learner, ACTOR_B, m.StatusRequest())), m.Status)
        during = _in_a_thread(lambda: ask(learner, ACTOR_A, m.LeaseRequest(max_groups=GROUPS_PER_STEP)))
        assert isinstance(during, m.Lease) and during.prompts and during.policy_version == 1
        ack = _in_a_thread(lambda: ask(learner, ACTOR_A, rollouts_for(during, incarnation=learner.state.incarnation)))
        assert ack.status == "accepted"
    finally:
        release.set()
        training.join(120)
    assert not training.is_alive()
    # The checkpoint is the state at the end of the step: the work done during the write is not in it.
    saved = persistence.read_state(learner.run_dir / "checkpoints" / "step_000001")
    assert saved["step"] == 1 and saved["buffer"] == []
    assert saved["ledger_bytes"] < (learner.run_dir / "ledger.jsonl").stat().st_size
    assert [g for lease in saved["scheduler"]["leases"] for g, _ in lease["tickets"]] == []
    # Not finished in it either: the saved state never handed those groups out (finished = handed out, not live).
    assert all(int(p.group_id[1:]) > saved["scheduler"]["serial"] for p in during.prompts)


def test_kill_between_staging_and_rename_leaves_previous_checkpoint(make_learner, monkeypatch):
    import grpo_fleet.models.loading as model_module
    from grpo_fleet.models.loading import latest_checkpoint

    learner = make_learner(train={"steps": 5, "checkpoint_every": 100})
    good = learner.checkpoint()
    learner.state.step = 1  # pretend a step happened so the next checkpoint is a new directory

    class Killed(BaseException):
        pass

    def die(staging, final):
        assert (staging / "learner_state.msgpack").exists(), "everything is written before the swap"
        raise Killed()

    monkeypatch.setattr(model_module, "_commit_dir", die)
    with pytest.raises(Killed):
        learner.checkpoint()
    monkeypatch.undo()
    assert latest_checkpoint(learner.run_dir) == good
    assert not (learner.run_dir / "checkpoints" / "step_000001").exists()
    assert_checkpoint_generates_like_the_learner(good, "12=", max_tokens=2)


def test_rollouts_after_the_final_step_are_not_accepted(make_learner):
    learner = make_learner(train={"steps": 1, "checkpoint_every": 1})
    hello(learner)
    first = lease(learner)
    late = lease(learner)
    ask(learner, ACTOR_A, generated_rollouts(learner, first))
    learner.train_step()
    assert learner.state.done
    before = ledger(learner, events=True)
    ack = ask(learner, ACTOR_A, rollouts_for(late))
    assert ack.status == "stale" and ack.reason == RejectReason.RUN_DONE
    assert ledger(learner, events=True) == before, "the ledger matches the final checkpoint"


# ----------------------------------------------------------------- hostile input at the door

HOSTILE_HEARTBEAT_VALUES = [-1, -(2**63), 2**31, 2**63 - 1, 2**64 - 1, float("nan"), float("inf"), -float("inf"), 1e39, -3e38]


def _through_the_door(field: str, value: object) -> Optional[m.Heartbeat]:
    """What the server would pass to `handle` for this Heartbeat: None when the codec refuses it."""
    import msgpack

    from grpo_fleet.protocol.codec import ProtocolError, decode

    body = {"actor_id": "actor-a", "policy_version": 0, "sent_at": 0.0, field: value}
    try:
        return decode(msgpack.packb({"v": m.PROTOCOL_VERSION, "type": "Heartbeat", "body": body}))
    except ProtocolError:
        return None


def test_status_still_validates_after_hostile_heartbeats(learner):
    """Issue F.3: one Heartbeat(policy_version=-1) used to make every StatusRequest an internal error."""
    hello(learner)
    hello(learner, ACTOR_B, "actor-b")
    for field in ("policy_version", "sent_at"):
        for value in HOSTILE_HEARTBEAT_VALUES:
            msg = _through_the_door(field, value)
            if msg is not None:
                assert isinstance(ask(learner, ACTOR_A, msg), m.Heartbeat)
            # Asked after every single one: any of them alone used to be enough.
            status = ask(learner, ACTOR_B, m.StatusRequest())
            assert isinstance(status, m.Status)
            assert m.Status.model_validate(status.model_dump(), strict=True) == status
            assert [a.policy_version for a in status.actors] == [0, 0], (field, value)


def test_hello_beyond_max_actors_is_refused_and_counted(make_learner):
    learner = make_learner(server={"max_actors": 2})
    hello(learner, b"one", "one")
    hello(learner, b"two", "two")
    reply = ask(learner, b"three", m.Hello(actor_id="three", host="h", backend="cpu", versions={}))
    assert isinstance(reply, m.ErrorReply) and reply.reason == "too_many_actors"
    assert "server.max_actors" in reply.detail
    assert sample(learner, "grpo_fleet_learner_protocol_errors_total", {"reason": "too_many_actors"}) == 1
    assert set(learner.registry.actors) == {b"one", b"two"}
    hello(learner, b"two", "two")  # a registered actor may always say Hello again
    learner.drop_actor(b"one")
    hello(learner, b"three", "three")  # room again once one has gone


def test_a_poisoned_group_past_the_door_skips_the_update_and_is_charged_to_its_actor(learner):
    # Defence in depth: a value the door should have refused reaches the trainer anyway.
    from mlx.utils import tree_flatten

    hello(learner)
    fill_buffer(learner)
    poisoned = learner.state.buffer[0]
    poisoned.completions[1].logprobs = np.full_like(poisoned.completions[1].logprobs, np.nan)
    before = {k: np.array(v) for k, v in tree_flatten(learner.policy.model.trainable_parameters())}

    record = learner.train_step()

    assert record.skipped == "nonfinite_loss"
    after = dict(tree_flatten(learner.policy.model.trainable_parameters()))
    assert all(np.array_equal(before[k], np.array(after[k])) for k in before), "the weights did not move"
    assert sample(learner, "grpo_fleet_learner_skipped_updates_total", {"reason": "nonfinite_loss"}) == 1
    assert learner.registry.bans.violations(ACTOR_A.hex()) == 1, "the group's actor is charged"
    assert sample(learner, "grpo_fleet_learner_violations_total", {"reason": "poisoned_bad_logprob"}) == 1
    # and training goes on
    fill_buffer(learner)
    assert learner.train_step().skipped is None


def test_samples_are_decoded_by_the_learner_and_cut_back_on_resume(tiny_model_dir, tmp_path):
    cfg = run_config(tiny_model_dir, tmp_path / "run",
                     train={"steps": 5, "checkpoint_every": 2, "log_samples_every": 1, "log_samples_count": 3})
    first = build_learner(cfg)
    hello(first)
    leased = fill_buffer(first)
    first.train_step()
    for _ in range(2):  # steps 2 (checkpointed) and 3 (not)
        fill_buffer(first)
        first.train_step()
    path = first.run_dir / "samples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    first.close()
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    prompt = leased.prompts[0]
    tokens = prompt.prompt_tokens.to_numpy().tolist()
    assert rows[0]["prompt"] == first.policy.tokenizer.decode(tokens) != ""
    assert rows[0]["group_id"] == prompt.group_id and rows[0]["actor_id"] == "actor-a"
    # crafted_group: completion i of a group is token 7 + i % 3, 3 times; rewards INFORMATIVE, so best is i = 3.
    assert rows[0]["completion"] == first.policy.tokenizer.decode([7] * 3)
    assert (rows[0]["reward"], rows[1]["reward"], rows[0]["finish_reason"], rows[0]["num_tokens"]) == (1.0, 0.0, "length", 3)
    assert rows[0]["advantage"] > 0 > rows[1]["advantage"]

    second = build_learner(cfg, resume=True)
    try:
        assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 1, 2, 2, 2], \
            "step 3 came after the checkpoint, so its samples go with it"
    finally:
        second.close()


# ----------------------------------------------------------------- the learner's own bugs are not the peer's fault


def test_a_learner_bug_in_validation_is_internal_never_a_violation(make_learner, monkeypatch, caplog):
    """A validator that raises (instead of refusing) is the learner's bug: logged with a traceback, never charged."""
    from grpo_fleet.protocol.codec import ProtocolError, decode, encode

    def buggy(cls: type, *args: object, **kwargs: object) -> object:
        raise KeyError("learner-side validation bug")

    learner = make_learner(server={"max_violations": 2})
    hello(learner)
    honest = encode(m.Heartbeat(actor_id="actor-a", policy_version=0, sent_at=0.0))
    monkeypatch.setattr(m.Heartbeat, "model_validate", classmethod(buggy))
    for _ in range(3):  # more than server.max_violations
        try:
            decoded: object = decode(honest)
        except ProtocolError as error:
            decoded = error
        assert isinstance(decoded, ProtocolError) and decoded.reason == "internal"
        reply = ask(learner, ACTOR_A, decoded)
        assert isinstance(reply, m.ErrorReply) and reply.reason == "internal"
    assert learner.registry.bans.violations(ACTOR_A.hex()) == 0 and not learner.registry.is_banned(ACTOR_A.hex())
    assert sample(learner, "grpo_fleet_learner_internal_errors_total", {"where": "decode"}) == 3
    assert sample(learner, "grpo_fleet_learner_protocol_errors_total", {"reason": "internal"}) == 0
    assert "Traceback" in caplog.text and "KeyError: 'learner-side validation bug'" in caplog.text, "with its traceback"

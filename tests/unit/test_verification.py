"""The learner's checks of what actors report (learner/verification.py), on a real tiny learner; no sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
from test_learner_core import ACTOR_A, ask, generated_rollouts, hello, lease, run_config

from grpo_fleet.learner.core import Learner
from grpo_fleet.learner.setup import build_learner
from grpo_fleet.learner.verification import RewardCheck, reward_gap
from grpo_fleet.metrics import learner_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks.prompts import decode_completion
from grpo_fleet.tasks.reward_runner import InlineScorer
from helpers import audit_ledger


@pytest.fixture
def make(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Learner]]:
    built: list[Learner] = []

    def build(**sections: dict) -> Learner:
        built.append(build_learner(run_config(tiny_model_dir, tmp_path / f"run{len(built)}", **sections)))
        return built[-1]

    yield build
    for learner in built:
        learner.close()


def rejections(learner: Learner, reason: RejectReason) -> float:
    return learner.metrics.registry.get_sample_value("grpo_fleet_learner_rejections_total", {"reason": reason}) or 0.0


def test_the_learner_re_scores_in_a_process_of_its_own_unless_given_a_scorer(
        make: Callable[..., Learner], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never an in-process fallback, which could not interrupt a reward that hangs; a test passes its own scorer."""
    import grpo_fleet.learner.core as core

    started: list[object] = []

    class RecordedProcess:  # stands in for ScoringProcess: a unit test starts no process
        def __init__(self, rewards: object) -> None:
            started.append(rewards)

        def close(self) -> None:
            pass

    monkeypatch.setattr(core, "ScoringProcess", RecordedProcess, raising=False)
    parts = make()
    cfg = parts.cfg.model_copy(update={"security": parts.cfg.security.model_copy(update={"verify_rewards": True})})

    def learner_from_parts(name: str, **scorer: object) -> Learner:
        (tmp_path / name).mkdir()
        return Learner(cfg, parts.policy, parts.trainer, parts.task, parts.prompt_tokens, parts.model_digest,
                       learner_metrics(), tmp_path / name, **scorer)  # type: ignore[arg-type]

    default = learner_from_parts("default")
    assert default.reward_check is not None and isinstance(default.reward_check.scorer, RecordedProcess)
    assert started == [parts.task.reward_set()]
    inline = InlineScorer(parts.task.reward_set())
    given = learner_from_parts("given", scorer=inline)
    assert given.reward_check is not None and given.reward_check.scorer is inline and len(started) == 1
    for learner in (default, given):
        learner.close()


def test_reward_gap_is_relative_to_the_reward() -> None:
    assert reward_gap([1.0, 100.0], [1.0, 100.00001]) < 1e-6
    assert reward_gap([1.25], [1.0]) == pytest.approx(0.25)


def test_rewards_are_re_scored_from_the_tokens_and_the_learners_answer(make: Callable[..., Learner]) -> None:
    learner = make()
    hello(learner)
    msg = generated_rollouts(learner, lease(learner))
    task, tokenizer = learner.task, learner.policy.tokenizer
    eos = set(tokenizer.eos_token_ids)
    honest_groups = []
    for item, group in zip(learner.state.scheduler.leases[msg.lease_id].tickets.values(), msg.groups):
        example = task.train[item.prompt_index]
        rewards = [task.score(decode_completion(tokenizer, c.tokens.to_numpy().tolist(), c.finish_reason, eos), example)
                   for c in group.completions]
        honest = group.model_copy(update={"completions": [c.model_copy(update={"reward": r})
                                                          for c, r in zip(group.completions, rewards)]})
        honest_groups.append((honest, item.prompt_index))
    check = RewardCheck(task, task.train, tokenizer, InlineScorer(task.reward_set()))
    assert set(check.verdicts(honest_groups).values()) == {None}
    lied = [(g.model_copy(update={"completions": [c.model_copy(update={"reward": c.reward + 0.25})
                                                  for c in g.completions]}), i) for g, i in honest_groups]
    assert set(check.verdicts(lied).values()) == {RejectReason.REWARD_MISMATCH}


def test_honest_logprobs_pass_and_the_group_trains(make: Callable[..., Learner]) -> None:
    learner = make(security={"verify_logprobs": True})
    hello(learner)
    assert ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner))).status == "accepted"
    assert sum(g.check_logprobs for g in learner.state.buffer) == 1, "one group per submission is checked"
    record = learner.train_step()
    assert record is not None and learner.state.step == 1
    count = learner.metrics.registry.get_sample_value("grpo_fleet_learner_logprob_gap_nats_count")
    under = learner.metrics.registry.get_sample_value("grpo_fleet_learner_logprob_gap_nats_bucket", {"le": "0.001"})
    assert count == 1 and under == 1, "the actor's sampler and the learner agree to under 1e-3 nats"


def test_altered_logprobs_ban_the_actor_and_nothing_of_it_trains(make: Callable[..., Learner]) -> None:
    learner = make(security={"verify_logprobs": True})
    hello(learner)
    msg = generated_rollouts(learner, lease(learner))
    halved = [g.model_copy(update={"completions": [
        c.model_copy(update={"logprobs": m.Tensor.from_numpy((c.logprobs.to_numpy() * 0.5).astype(np.float32))})
        for c in g.completions]}) for g in msg.groups]
    assert ask(learner, ACTOR_A, msg.model_copy(update={"groups": halved})).status == "accepted"
    assert learner.train_step() is None, "no step: the batch's checked group failed"
    assert learner.state.step == 0 and learner.state.buffer == []
    assert learner.registry.is_banned(next(iter(learner.registry.actors.values())).principal)
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == len(halved)
    assert len(learner.state.scheduler.queued_groups) == len(halved), "their prompts go to other actors"
    _assert_ledgered_drops(learner, {g.group_id for g in halved}, RejectReason.LOGPROB_MISMATCH)


def _assert_ledgered_drops(learner: Learner, groups: set[str], reason: RejectReason) -> None:
    """Each dropped group has its drop line in the ledger, naming the new group its prompt was retried as."""
    learner.runlog.sizes()  # flushes
    audit = audit_ledger(Path(learner.cfg.run_dir) / "ledger.jsonl")
    assert set(audit.dropped) == groups
    assert {d["reason"] for d in audit.dropped.values()} == {str(reason)}
    retried = {d["retried_as"] for d in audit.dropped.values()}
    assert retried == {t.group_id for t in learner.state.scheduler.queued_groups}


def test_groups_beyond_max_train_staleness_are_dropped_when_the_batch_is_taken(make: Callable[..., Learner]) -> None:
    learner = make(grpo={"max_staleness": 2, "max_train_staleness": 0})
    hello(learner)
    ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner)))
    buffered = {g.group_id for g in learner.state.buffer}
    accepted = len(buffered)
    learner.state.version += 1  # as if a step had published meanwhile
    assert learner.train_step() is None
    assert rejections(learner, RejectReason.STALE_AT_TRAIN) == accepted
    assert len(learner.state.scheduler.queued_groups) == accepted
    _assert_ledgered_drops(learner, buffered, RejectReason.STALE_AT_TRAIN)

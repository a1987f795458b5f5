"""The learner's checks of what actors report (learner/verify/actor_checks.py), on a real tiny
learner; no sockets."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
from test_learner_core import (
    ACTOR_A,
    GROUP_SIZE,
    GROUPS_PER_STEP,
    INFORMATIVE,
    MAX_TOKENS,
    ask,
    generated_rollouts,
    hello,
    lease,
)

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.learner.step.gap_bounds import HALF_PRECISION_BOUND, HALF_PRECISION_MEAN_FLOOR, default_bound
from grpo_fleet.learner.verify.actor_checks import RewardCheck, reward_gap
from grpo_fleet.learner.verify.verification import calibration_settings
from grpo_fleet.models.generation import SamplingSettings, generate_groups
from grpo_fleet.models.loading import load_policy
from grpo_fleet.observe.metrics import learner_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks.prompts import decode_completion
from grpo_fleet.tasks.reward_runner import InlineScorer
from helpers import audit_ledger
from helpers import jsonl as json_lines
from in_process import build_learner


def rejections(learner: RunCoordinator, reason: RejectReason) -> float:
    return learner.metrics.registry.get_sample_value("grpo_fleet_learner_rejections_total", {"reason": reason}) or 0.0


def test_the_learner_re_scores_in_a_process_of_its_own_unless_given_a_scorer(
        make: Callable[..., RunCoordinator], tmp_path: Path) -> None:
    """Never an in-process fallback, which could not interrupt a reward that hangs; a unit test passes its own."""
    import inspect

    from grpo_fleet.envs.process import EnvProcess
    from grpo_fleet.learner.run.build import build_learner as build_with_processes
    from grpo_fleet.tasks.reward_runner import ScoringProcess

    # Both ways in default to a scoring process (starting one here would break the unit tests' rule), and replay a
    # deterministic environment in a process of its own too, which can be killed when the actor's turns hang it.
    for built_by in (RunCoordinator, build_with_processes):
        assert inspect.signature(built_by).parameters["make_scorer"].default is ScoringProcess, built_by
        assert inspect.signature(built_by).parameters["make_envs"].default is EnvProcess, built_by
    parts = make()
    cfg = parts.cfg.model_copy(update={"security": parts.cfg.security.model_copy(update={"verify_rewards": True})})
    inline = InlineScorer(parts.task.reward_set())
    given = RunCoordinator(cfg, parts.policy, parts.trainer, parts.task, parts.prompt_tokens, parts.model_digest,
                    learner_metrics(), tmp_path, make_scorer=lambda rewards: inline)
    assert given.verification.reward_check is not None and given.verification.reward_check.scorer is inline
    off = cfg.model_copy(update={"security": cfg.security.model_copy(update={"verify_rewards": False})})
    (tmp_path / "off").mkdir()
    unchecked = RunCoordinator(off, parts.policy, parts.trainer, parts.task, parts.prompt_tokens, parts.model_digest,
                        learner_metrics(), tmp_path / "off", make_scorer=lambda rewards: inline)
    assert unchecked.verification.reward_check is None, "no re-scoring, no scorer"
    for learner in (given, unchecked):
        learner.close()


def test_reward_gap_is_relative_to_the_reward() -> None:
    assert reward_gap([1.0, 100.0], [1.0, 100.00001]) < 1e-6
    assert reward_gap([1.25], [1.0]) == pytest.approx(0.25)


def test_rewards_are_re_scored_from_the_tokens_and_the_learners_answer(make: Callable[..., RunCoordinator]) -> None:
    learner = make()
    hello(learner)
    msg = generated_rollouts(learner, lease(learner))
    task, tokenizer = learner.task, learner.policy.tokenizer
    eos = set(tokenizer.eos_token_ids)
    honest_groups = []
    for item, group in zip(learner.state.scheduler.ledger.leases[msg.lease_id].tickets.values(), msg.groups):
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


def test_honest_logprobs_pass_and_the_group_trains(make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True})
    hello(learner)
    assert ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner))).status == "accepted"
    assert sum(g.check_logprobs for g in learner.state.buffer) == 2, "every group is checked (up to 4 a submission)"
    record = learner.train_step()
    assert record is not None and learner.state.step == 1
    count = learner.metrics.registry.get_sample_value("grpo_fleet_learner_logprob_gap_nats_count")
    under = learner.metrics.registry.get_sample_value("grpo_fleet_learner_logprob_gap_nats_bucket", {"le": "0.001"})
    assert count == 2 and under == 2, "the actor's sampler and the learner agree to under 1e-3 nats"


def test_altered_logprobs_ban_the_actor_and_nothing_of_it_trains(make: Callable[..., RunCoordinator]) -> None:
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
    assert len(learner.state.scheduler.queue.tickets) == len(halved), "their prompts go to other actors"
    _assert_ledgered_drops(learner, {g.group_id for g in halved}, RejectReason.LOGPROB_MISMATCH)


def _assert_ledgered_drops(learner: RunCoordinator, groups: set[str], reason: RejectReason) -> None:
    """Each dropped group has its drop line in the ledger, naming the new group its prompt was retried as."""
    learner.runlog.sizes()  # flushes
    audit = audit_ledger(Path(learner.cfg.run_dir) / "ledger.jsonl")
    assert set(audit.dropped) == groups
    assert {d["reason"] for d in audit.dropped.values()} == {str(reason)}
    retried = {d["retried_as"] for d in audit.dropped.values()}
    assert retried == {t.group_id for t in learner.state.scheduler.queue.tickets}


def test_groups_beyond_max_train_staleness_are_dropped_when_the_batch_is_taken(make: Callable[..., RunCoordinator]) -> None:
    learner = make(grpo={"max_staleness": 2, "max_train_staleness": 0})
    hello(learner)
    ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner)))
    buffered = {g.group_id for g in learner.state.buffer}
    accepted = len(buffered)
    learner.state.version += 1  # as if a step had published meanwhile
    assert learner.train_step() is None
    assert rejections(learner, RejectReason.STALE_AT_TRAIN) == accepted
    assert len(learner.state.scheduler.queue.tickets) == accepted
    _assert_ledgered_drops(learner, buffered, RejectReason.STALE_AT_TRAIN)


def shifted(msg: m.Rollouts, nats: float, first: int = 0) -> m.Rollouts:
    """`msg` with every logprob of its groups from index `first` on moved by `nats` (a stale or lying actor's)."""
    def moved(c: m.Completion) -> m.Completion:
        return c.model_copy(update={"logprobs": m.Tensor.from_numpy((c.logprobs.to_numpy() + nats).astype(np.float32))})
    groups = [g if i < first else g.model_copy(update={"completions": [moved(c) for c in g.completions]})
              for i, g in enumerate(msg.groups)]
    return msg.model_copy(update={"groups": groups})


def gpu_hello(learner: RunCoordinator) -> None:
    """An actor on Metal told no dtype: it samples in the checkpoint's, which may be bfloat16."""
    assert isinstance(ask(learner, ACTOR_A, m.Hello(actor_id="mac", host="mac", backend="Device(gpu, 0)",
                                                    versions={})), m.Welcome)


def test_a_float32_actor_two_hundredths_of_a_nat_off_is_caught(make: Callable[..., RunCoordinator]) -> None:
    # A proxy lifting the claimed version by one, or serving weights 1-2 versions stale, was 0.02-0.07 nats
    # off on the demo model (bench liar_lags): under the old one-size bound of 0.05 such groups trained.
    learner = make(security={"verify_logprobs": True})
    hello(learner)
    assert ask(learner, ACTOR_A, shifted(generated_rollouts(learner, lease(learner)), -0.02)).status == "accepted"
    assert learner.train_step() is None and learner.state.step == 0 and learner.state.buffer == []
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == 2


def test_a_liar_behind_an_honest_first_group_is_caught(make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True})
    hello(learner)
    msg = shifted(generated_rollouts(learner, lease(learner)), -0.5, first=1)
    assert ask(learner, ACTOR_A, msg).status == "accepted"
    assert learner.train_step() is None, "every informative group of the submission was checked, not only the first"
    assert learner.registry.is_banned(next(iter(learner.registry.actors.values())).principal)


def test_an_actor_on_probation_has_every_group_flagged_and_a_new_hello_restarts_it(
        make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True, "probation_groups": 4, "check_share": 1e-9})
    hello(learner)
    ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner)))
    assert [g.check_logprobs for g in learner.state.buffer] == [True] * GROUPS_PER_STEP, "on probation: all of them"
    key = next(iter(learner.registry.actors.values())).principal
    learner.verification.trust.record_pass(key, 4)
    learner.state.buffer.clear()
    ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner)))
    assert not any(g.check_logprobs for g in learner.state.buffer), "trusted, and the share drew none"
    hello(learner)  # a restarted actor (or learner): trust is earned again
    assert learner.verification.trust.on_probation(key)


def test_an_honest_bfloat16_actor_passes_its_own_bound(make: Callable[..., RunCoordinator], tiny_model_dir: Path) -> None:
    learner = make(security={"verify_logprobs": True})
    gpu_hello(learner)
    lease_msg = lease(learner)
    actor = load_policy(str(tiny_model_dir), dtype="bfloat16")  # what a Mac samples in
    prompts = [p.prompt_tokens.to_numpy() for p in lease_msg.prompts]
    groups = [m.GroupResult(group_id=item.group_id, completions=[
        m.Completion(tokens=m.Tensor.from_numpy(np.asarray(c.tokens, np.int32)),
                     logprobs=m.Tensor.from_numpy(np.asarray(c.logprobs, np.float32)), reward=INFORMATIVE[i],
                     finish_reason="stop" if c.finish_reason == "stop" else "length") for i, c in enumerate(samples)])
        for item, samples in zip(lease_msg.prompts, generate_groups(
            actor.model, prompts, SamplingSettings(group_size=GROUP_SIZE, max_tokens=MAX_TOKENS,
                                                   stop_token_ids=sorted(actor.tokenizer.eos_token_ids))))]
    msg = m.Rollouts(lease_id=lease_msg.lease_id, policy_version=lease_msg.policy_version, groups=groups,
                     incarnation=learner.state.incarnation)
    assert ask(learner, ACTOR_A, msg).status == "accepted"
    assert learner.train_step() is not None, "bf16 rounding is not a lie"
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == 0
    # Uncalibrated, the bf16 ceiling lets the largest honest floor measured (SmolLM2-135M, 0.045 nats/token) pass;
    # calibrated on the tiny model, whose honest bf16 floor is 0.0015, the same gap is a lie.
    for calibration, caught in ((0, 0), (2, GROUPS_PER_STEP)):
        gpu = make(security={"verify_logprobs": True, "calibration_prompts": calibration})
        gpu_hello(gpu)
        assert ask(gpu, ACTOR_A, shifted(generated_rollouts(gpu, lease(gpu)), 0.045)).status == "accepted"
        gpu.train_step()
        assert rejections(gpu, RejectReason.LOGPROB_MISMATCH) == caught, calibration


def test_security_max_logprob_gap_overrides_the_dtypes_bound(make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True, "max_logprob_gap": 0.05})
    hello(learner)
    ask(learner, ACTOR_A, shifted(generated_rollouts(learner, lease(learner)), -0.02))
    assert learner.train_step() is not None and rejections(learner, RejectReason.LOGPROB_MISMATCH) == 0


def test_rewards_scored_ahead_are_not_scored_again_under_the_lock(make: Callable[..., RunCoordinator]) -> None:
    learner = make()
    hello(learner)
    msg = generated_rollouts(learner, lease(learner))
    indexes = [t.prompt_index for t in learner.state.scheduler.ledger.leases[msg.lease_id].tickets.values()]
    calls: list[int] = []
    scorer = InlineScorer(learner.task.reward_set())

    class Counting:
        def score(self, jobs):  # type: ignore[no-untyped-def]
            calls.append(len(jobs))
            return scorer.score(jobs)

    check = RewardCheck(learner.task, learner.task.train, learner.policy.tokenizer, Counting())  # type: ignore[arg-type]
    jobs = list(zip(msg.groups, indexes))
    check.score_ahead(jobs)
    ahead = check.verdicts(jobs)
    assert sum(calls) == len(jobs), "verdicts answered from what was scored ahead"
    copies = [(g.model_copy(), i) for g, i in jobs]
    assert check.verdicts(copies) == ahead and sum(calls) == 2 * len(jobs), "other objects are scored anew"
    check.forget_ahead()
    check.verdicts(jobs)
    assert sum(calls) == 3 * len(jobs)


def test_groups_checked_in_one_forward_get_the_gaps_each_gets_alone(make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True})
    hello(learner)
    ask(learner, ACTOR_A, shifted(generated_rollouts(learner, lease(learner)), -0.5, first=1))
    check = learner.verification.logprob_check
    assert check is not None
    groups = list(learner.state.buffer)
    together = check.gaps(groups)
    alone = [check.gap(group) for group in groups]
    assert len(groups) == 2 and all(gap is not None for gap in together + alone)
    assert [g.group_id for g in together if g] == [g.group_id for g in alone if g] == [g.group_id for g in groups]
    for joint, single in zip(together, alone):
        assert joint is not None and single is not None
        assert joint.mean == pytest.approx(single.mean, abs=1e-6) and joint.max == pytest.approx(single.max, abs=1e-5)
    honest, liar = together
    assert honest is not None and liar is not None and honest.mean < 1e-3 and liar.mean == pytest.approx(0.5, abs=0.01)


# ---------------------------------------------------------------- issue Q: never skipped, never fooled


def spiked(msg: m.Rollouts, nats: float) -> m.Rollouts:
    """`msg` with one token of its first group's first completion moved by `nats`: a concentrated lie."""
    group = msg.groups[0]
    first = group.completions[0]
    logprobs = first.logprobs.to_numpy().copy()
    logprobs[-1] += nats
    completions = [first.model_copy(update={"logprobs": m.Tensor.from_numpy(logprobs)}), *group.completions[1:]]
    return msg.model_copy(update={"groups": [group.model_copy(update={"completions": completions}), *msg.groups[1:]]})


def test_one_spiked_token_is_caught_where_the_mean_alone_lets_it_through(make: Callable[..., RunCoordinator]) -> None:
    # A mean bound of 1 nat (security.max_logprob_gap) is far beyond what one token moves the mean by here: only
    # the per-token bound (0.05 for a float32 pair) sees it.
    learner = make(security={"verify_logprobs": True, "max_logprob_gap": 1.0})
    hello(learner)
    assert ask(learner, ACTOR_A, spiked(generated_rollouts(learner, lease(learner)), 0.5)).status == "accepted"
    assert learner.train_step() is None and learner.state.step == 0
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == GROUPS_PER_STEP


def test_a_cut_off_completion_claimed_finished_is_refused(make: Callable[..., RunCoordinator]) -> None:
    learner = make()
    hello(learner)
    msg = generated_rollouts(learner, lease(learner))
    eos = set(learner.policy.tokenizer.eos_token_ids)
    cut = next(c for g in msg.groups for c in g.completions if c.finish_reason == "length")
    assert int(cut.tokens.to_numpy()[-1]) not in eos and cut.tokens.shape[0] == MAX_TOKENS
    lying = msg.model_copy(update={"groups": [g.model_copy(update={"completions": [
        c.model_copy(update={"finish_reason": "stop"}) if c is cut else c for c in g.completions]}) for g in msg.groups]})
    ack = ask(learner, ACTOR_A, lying)
    assert isinstance(ack, m.Ack) and (ack.status, ack.reason) == ("invalid", RejectReason.FINISH_REASON_MISMATCH)
    assert learner.state.buffer == [] and rejections(learner, RejectReason.FINISH_REASON_MISMATCH) == 1
    assert ask(learner, ACTOR_A, msg).status == "accepted", "the honest submission still goes through"


def test_a_flagged_group_behind_a_stale_one_is_still_checked(make: Callable[..., RunCoordinator]) -> None:
    """The batch is checked as taken: groups dropped as too stale cannot let an unchecked one slide in."""
    learner = make(security={"verify_logprobs": True}, grpo={"max_staleness": 2, "max_train_staleness": 0})
    hello(learner)
    early, late = lease(learner), lease(learner)
    assert ask(learner, ACTOR_A, generated_rollouts(learner, early)).status == "accepted"
    assert learner.train_step() is not None and learner.state.version == 1
    assert ask(learner, ACTOR_A, generated_rollouts(learner, late)).status == "accepted"  # v0: stale at train
    liar = shifted(generated_rollouts(learner, lease(learner)), -0.3)  # v1: lies
    assert ask(learner, ACTOR_A, liar).status == "accepted"
    assert learner.train_step() is None and learner.state.step == 1
    assert rejections(learner, RejectReason.STALE_AT_TRAIN) == GROUPS_PER_STEP
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == GROUPS_PER_STEP


def test_flagged_groups_keep_their_flags_and_bounds_through_a_checkpoint(make: Callable[..., RunCoordinator]) -> None:
    first = make(security={"verify_logprobs": True})
    hello(first)
    ask(first, ACTOR_A, generated_rollouts(first, lease(first)))
    buffered = [(g.group_id, g.check_logprobs, g.logprob_bound, g.token_bound) for g in first.state.buffer]
    assert buffered and all(flag for _, flag, _, _ in buffered)
    first.checkpoint()
    with resumed_from(first) as resumed:
        assert [(g.group_id, g.check_logprobs, g.logprob_bound, g.token_bound) for g in resumed.state.buffer] == buffered


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_resumed_learner_checks_older_versions_or_refuses_them(make: Callable[..., RunCoordinator], mode: str) -> None:
    """After a resume, work sampled one version back is still checked (LoRA: the checkpoint kept that version's
    adapters) or refused as version_gone (full fine-tuning): never trained unchecked."""
    sections = {"security": {"verify_logprobs": True, "probation_groups": 1000},
                "lora": {"enabled": mode == "lora"}, "grpo": {"beta": 0.0}}
    first = make(**sections)
    hello(first)
    ask(first, ACTOR_A, generated_rollouts(first, lease(first)))
    first.train_step()
    stale_lease = lease(first)
    stale = shifted(generated_rollouts(first, stale_lease), -0.3)  # sampled at v1, lying
    ask(first, ACTOR_A, generated_rollouts(first, lease(first)))
    assert first.train_step() is not None and first.state.version == 2
    first.checkpoint()
    with resumed_from(first) as resumed:
        hello(resumed)
        ack = ask(resumed, ACTOR_A, stale.model_copy(update={"lease_id": lease(resumed).lease_id,
                                                               "incarnation": first.state.incarnation}))
        assert isinstance(ack, m.Ack)
        if mode == "full":
            assert ack.reason == RejectReason.VERSION_GONE and resumed.state.buffer == []
            return
        assert ack.status == "accepted"
        assert sorted(resumed.verification.history.versions) == [0, 1, 2]  # type: ignore[union-attr]
        assert resumed.train_step() is None and rejections(resumed, RejectReason.LOGPROB_MISMATCH) == GROUPS_PER_STEP


@contextmanager
def resumed_from(first: RunCoordinator) -> Iterator[RunCoordinator]:
    """A learner resumed, in `first`'s run directory, from the checkpoint `first` wrote last (`first` is closed)."""
    first.close()
    second = build_learner(first.cfg, resume=True)
    try:
        yield second
    finally:
        second.close()


def test_the_learner_calibrates_the_half_precision_bound_on_its_own_model(make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True})
    ((dtype, bound),) = learner.verification.calibration.bounds()  # no training thread here: the first to ask measures
    # The tiny model's honest bf16 gaps are about 0.0015 nats: the bound sits near the floor, far under 0.15.
    assert dtype == "bfloat16" and HALF_PRECISION_MEAN_FLOOR <= bound.mean < HALF_PRECISION_BOUND / 10
    assert learner.verification.bounds.of("Device(gpu, 0)") == bound, "an actor of unknown dtype: bf16's"
    assert learner.verification.bounds.of("cpu") == default_bound("float32", "float32"), "fp32 keeps its own"
    assert make(security={"verify_logprobs": True, "calibration_prompts": 0}).verification.calibration.bounds() == ()


def test_calibration_samples_at_most_calibration_tokens_whatever_max_tokens() -> None:
    """Its cost must not grow with the answers' length (205 s at 256 tokens, issue 38)."""
    long = RunConfig.model_validate({"generation": {"max_tokens": 1024, "group_size": 8, "temperature": 0.7},
                                     "security": {"calibration_tokens": 32}})
    settings = calibration_settings(long, [2, 1])
    assert (settings.max_tokens, settings.group_size, settings.temperature, settings.stop_token_ids) == (32, 8, 0.7, [1, 2])
    short = long.model_copy(update={"generation": long.generation.model_copy(update={"max_tokens": 12})})
    assert calibration_settings(short, [2]).max_tokens == 12


def _one_behind(learner: RunCoordinator) -> m.Rollouts:
    """An honest submission sampled at version 0, returned once the learner has stepped to version 1."""
    hello(learner)
    early = generated_rollouts(learner, lease(learner))  # sampled now, under version 0's weights
    assert ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner))).status == "accepted"
    assert learner.train_step() is not None and learner.state.version == 1
    return early


def checks(learner: RunCoordinator, how: str, result: str) -> float:
    labels = {"how": how, "result": result}
    return learner.metrics.registry.get_sample_value("grpo_fleet_learner_logprob_checks_total", labels) or 0.0


def test_a_spike_in_an_unchecked_older_group_is_caught_by_the_steps_screen(make: Callable[..., RunCoordinator]) -> None:
    """Past probation at a share of ~0 nothing recomputes an older group: only the step's screen sees the spike."""
    learner = make(security={"verify_logprobs": True, "probation_groups": 0, "check_share": 1e-9},
                   grpo={"max_staleness": 2})
    liar = spiked(_one_behind(learner), -20.0)
    assert ask(learner, ACTOR_A, liar).status == "accepted"
    assert not any(g.check_logprobs for g in learner.state.buffer), "sampled out: no forward check"
    assert learner.train_step() is None and learner.state.step == 1, "nothing of it trained"
    assert learner.registry.is_banned(next(iter(learner.registry.actors.values())).principal)
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == GROUPS_PER_STEP
    assert checks(learner, "screen", "failed") == 1 and checks(learner, "screen", "cleared") == 0


def test_an_honest_older_group_beyond_the_screen_is_recomputed_cleared_and_trained(
        make: Callable[..., RunCoordinator]) -> None:
    # A screen of 1e-4 nats: an honest group's drift over one step at lr 1e-3 breaks it (the tiny model's logprobs
    # move ~1e-6 at the default lr), so it is recomputed whole at its version.
    learner = make(security={"verify_logprobs": True, "probation_groups": 0, "check_share": 1e-9,
                             "screen_token_nats": 1e-4}, grpo={"max_staleness": 2}, optim={"lr": 1e-3})
    assert ask(learner, ACTOR_A, _one_behind(learner)).status == "accepted"
    assert learner.train_step() is None and learner.state.step == 1, "the screen drops the first try"
    assert len(learner.state.buffer) == GROUPS_PER_STEP, "the batch is back, untrained"
    assert checks(learner, "screen", "cleared") == GROUPS_PER_STEP
    assert learner.train_step() is not None and learner.state.step == 2, "the retry trains them, unscreened"
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == 0
    assert not learner.registry.is_banned(next(iter(learner.registry.actors.values())).principal)


def test_a_cleared_group_dropped_before_its_retry_is_forgotten(make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True, "probation_groups": 0, "check_share": 1e-9,
                             "screen_token_nats": 1e-4}, grpo={"max_staleness": 2}, optim={"lr": 1e-3})
    assert ask(learner, ACTOR_A, _one_behind(learner)).status == "accepted"
    assert learner.train_step() is None
    checks_ = learner.training.checks
    assert len(checks_.cleared) == GROUPS_PER_STEP
    with learner.lock:
        learner.handoff.drop(list(learner.state.buffer), RejectReason.STALE_AT_TRAIN)  # as a stale drop does
        checks_.plan([], learner.state.version, learner.state.weights_published)
    assert checks_.cleared == set()


@pytest.mark.parametrize("verify", [True, False])
def test_every_trained_group_is_checked_or_counted_unchecked_with_its_reason(
        make: Callable[..., RunCoordinator], verify: bool) -> None:
    """After probation at a share of ~0, older groups train unchecked: each is counted, ledgered and in its step line."""
    learner = make(security={"verify_logprobs": verify, "probation_groups": 0, "check_share": 1e-9},
                   grpo={"max_staleness": 2})
    hello(learner)
    early = lease(learner)
    assert ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner))).status == "accepted"
    assert learner.train_step() is not None  # v0 groups at the step's version: checked in the step when verifying
    assert ask(learner, ACTOR_A, generated_rollouts(learner, early)).status == "accepted"  # v0, now one behind
    assert learner.train_step() is not None
    learner.runlog.sizes()  # flushes
    steps = [line for line in json_lines(Path(learner.cfg.run_dir) / "metrics.jsonl") if "event" not in line]
    assert [(s["groups_checked"], s["groups_unchecked"]) for s in steps] == (
        [(GROUPS_PER_STEP, 0), (0, GROUPS_PER_STEP)] if verify else [(0, GROUPS_PER_STEP)] * 2)
    reason = "sampled_out" if verify else "verification_off"
    audit = audit_ledger(Path(learner.cfg.run_dir) / "ledger.jsonl")
    assert list(audit.unchecked.values()) == [reason] * (GROUPS_PER_STEP if verify else 2 * GROUPS_PER_STEP)
    counted = learner.metrics.registry.get_sample_value("grpo_fleet_learner_groups_unchecked_total", {"reason": reason})
    assert counted == len(audit.unchecked)


def test_a_reward_timeout_is_charged_to_the_submitter_and_its_prompts_go_to_another_actor(
        make: Callable[..., RunCoordinator]) -> None:
    """Issue 29: completions that run the learner's reward to its timeout cost ~10 s each, again and again,
    because the prompt went back to the same actor; it was `reward_unverifiable`, nobody's fault."""
    from test_learner_core import ACTOR_B

    from grpo_fleet.tasks.scoring import GroupScore, RewardError, RewardFailure

    learner = make(security={"verify_rewards": True})
    assert learner.verification.reward_check is not None

    real = learner.verification.reward_check.scorer

    scored: list[int] = []

    class TimesOut:
        def score(self, jobs):  # type: ignore[no-untyped-def]
            scored.append(len(jobs))
            return [GroupScore(failure=RewardFailure("slow", RewardError.TIMEOUT, "ran past 10s")) for _ in jobs]

        def close(self) -> None:
            real.close()

    learner.verification.reward_check.scorer = TimesOut()  # type: ignore[assignment]
    hello(learner)
    hello(learner, ACTOR_B, "actor-b")
    lease_msg = lease(learner)
    ack = ask(learner, ACTOR_A, generated_rollouts(learner, lease_msg))
    assert isinstance(ack, m.Ack) and set(ack.groups.values()) == {"invalid"}
    assert rejections(learner, RejectReason.REWARD_TIMEOUT) == len(lease_msg.prompts) > 1
    assert sum(scored) == 1, "after one timeout, the submission's other groups are not scored (each costs as long)"
    assert learner.registry.bans.violations(ACTOR_A.hex()) == len(lease_msg.prompts)
    timed_out = {p.group_id for p in lease_msg.prompts}
    again = lease(learner)  # the same actor gets other prompts...
    assert again.prompts and not timed_out & {p.group_id for p in again.prompts}
    other = lease(learner, ACTOR_B)  # ...and another actor gets these
    assert timed_out <= {p.group_id for p in other.prompts}

"""The learner's side of episodes (issue 28): Welcome names the environment, leases carry the conversation, the
door takes episodes (and only in a run with an environment), the step trains on sampled tokens only, and a
deterministic environment's episodes are replayed to check them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import numpy as np
import pytest
from test_learner_core import ask, hello, lease, rejections

from grpo_fleet.actor.episodes import episode_starts, score_episodes
from grpo_fleet.actor.rewarding import RunRewards
from grpo_fleet.config import RunConfig
from grpo_fleet.envs.hosting import InlineEnvs
from grpo_fleet.envs.runner import EpisodeLimits, EpisodeRunner
from grpo_fleet.launch.demo import DemoOptions, demo_settings
from grpo_fleet.learner.actors.registry import ActorInfo
from grpo_fleet.learner.door.intake_rules import IntakeRules, accepted_group, inbound_limits
from grpo_fleet.learner.records.persistence import group_from_dict, group_to_dict
from grpo_fleet.learner.records.samples import sample_rows, tokenizer_decode
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.learner.run.local_eval import LocalEvaluator
from grpo_fleet.learner.step.batch import LengthShaping, batch_totals, build_train_batch, split_batch
from grpo_fleet.learner.step.fused_check import fused_check
from grpo_fleet.learner.verify.actor_checks import LogprobCheck, WeightHistory
from grpo_fleet.learner.verify.env_replay import EnvNotVerifiable
from grpo_fleet.models.generation import SamplingSettings, TurnEnd
from grpo_fleet.models.zoo import ZooError
from grpo_fleet.observe.metrics import actor_metrics
from grpo_fleet.observe.samples_view import format_row, row_from_json
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks.env_module import env_digest
from grpo_fleet.tasks.prompts import chat_messages, encode_prompt
from grpo_fleet.tasks.reward_runner import InlineScorer
from in_process import build_learner

DEMO = Path(__file__).resolve().parents[2] / "src/grpo_fleet/demos/smollm2-135m-instruct"
QUIZ = "grpo_fleet.envs.capital_quiz"
SYSTEM = "Answer in one short sentence."
GROUP, MAX_TOKENS, BUDGET = 4, 6, 160
A = b"actor-a-identity"

# A user's environment that does not say it is deterministic (and is not: its reward is random).
COIN_ENV = '''
import random

class Coin:
    def __init__(self, env_config, extras):
        pass

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        return {"observations": [], "reward": random.random(), "done": True, "metadata": {}}
'''


def env_config(model_dir: Path, run_dir: Path, **sections: dict) -> RunConfig:
    data: dict[str, Any] = {
        "run_dir": str(run_dir),
        "model": {"path": str(model_dir)},
        "task": {"name": "jsonl", "train_path": str(DEMO / "capitals_train.jsonl"),
                 "eval_path": str(DEMO / "capitals_eval.jsonl"), "rewards": [], "chat_template": True,
                 "system_prompt": SYSTEM, "env": f"{QUIZ}:CapitalQuiz", "max_turns": 2,
                 "max_episode_tokens": BUDGET},
        "generation": {"group_size": GROUP, "max_tokens": MAX_TOKENS},
        "grpo": {"groups_per_step": 2, "beta": 0.04},
        "train": {"steps": 3, "checkpoint_every": 10},
        "metrics": {"port": 0},
        "security": {"verify_rewards": True, "verify_logprobs": False},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return RunConfig.model_validate(data)


@pytest.fixture
def make(tiny_chat_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., RunCoordinator]]:
    built: list[RunCoordinator] = []

    def build(**sections: dict) -> RunCoordinator:
        learner = build_learner(env_config(tiny_chat_model_dir, tmp_path / f"run{len(built)}", **sections))
        built.append(learner)
        return learner

    yield build
    for learner in built:
        learner.close()


class TurnLog(EpisodeRunner):
    """The real runner, keeping each turn's ids as the generator sampled them (before the episode records them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampled: dict[int, list[list[int]]] = {}

    def _send_steps(self, episodes: Any, ends: list[TurnEnd], waiting: dict) -> None:
        for end in ends:
            self.sampled.setdefault(end.key, []).append(list(end.tokens))
        super()._send_steps(episodes, ends, waiting)


def run_episodes(learner: RunCoordinator) -> tuple[m.Lease, m.Rollouts, TurnLog]:
    """What an actor does after Hello with an episode lease: the real runner and scoring, environments in this
    process; the lease, the Rollouts it would send, and the runner (which kept each turn as sampled)."""
    welcome = hello(learner)
    lease_msg = lease(learner)
    assert welcome.env is not None and learner.task.env is not None
    mx.random.seed(3)
    tokenizer = learner.policy.tokenizer
    settings = SamplingSettings(group_size=GROUP, max_tokens=MAX_TOKENS, temperature=1.0,
                                stop_token_ids=sorted(tokenizer.eos_token_ids))
    runner = TurnLog(learner.policy.model, tokenizer, settings,
                     EpisodeLimits(welcome.env.max_turns, welcome.env.max_episode_tokens),
                     InlineEnvs(learner.task.env))
    outcomes = runner.run(episode_starts(lease_msg, welcome, welcome.env))
    metrics = actor_metrics()
    groups, unscored = score_episodes(lease_msg.prompts, outcomes, RunRewards(), tokenizer, metrics)
    assert not unscored
    episodes = [o for group in outcomes for o in group]
    environment = sum(len(o.completion.tokens) - sum(o.completion.episode.mask) for o in episodes if o.completion.episode)
    read = metrics.registry.get_sample_value
    assert read("grpo_fleet_actor_env_seconds_count") == len(episodes)
    assert read("grpo_fleet_actor_episode_tokens_total", {"kind": "environment"}) == environment
    assert read("grpo_fleet_actor_episode_turns_sum") == sum(o.turns for o in episodes)
    return lease_msg, m.Rollouts(lease_id=lease_msg.lease_id, policy_version=lease_msg.policy_version,
                                 incarnation=learner.state.incarnation, groups=groups), runner


def records(rollouts: m.Rollouts, lease_msg: m.Lease) -> list[Any]:
    """The groups as the learner keeps them (intake_rules.accepted_group), each with its own prompt."""
    actor = ActorInfo(actor_id="a", host="h", backend="cpu", principal="k", last_seen=0.0)
    return [accepted_group(g, p.prompt_index, p.prompt_tokens.to_numpy(), 0, actor)
            for g, p in zip(rollouts.groups, lease_msg.prompts)]


def test_welcome_names_the_environment_and_leases_carry_the_conversation(make):
    learner = make()
    welcome = hello(learner)
    assert welcome.env is not None and welcome.reward.names == []
    assert (welcome.env.class_name, welcome.env.max_turns, welcome.env.max_episode_tokens) == ("CapitalQuiz", 2, BUDGET)
    assert welcome.env.module_digest == env_digest(QUIZ)
    lease_msg = lease(learner)
    for item in lease_msg.prompts:
        example = learner.task.train[item.prompt_index]
        assert item.messages == chat_messages(example.prompt, SYSTEM)
        rendered = encode_prompt(learner.policy.tokenizer, item.messages, chat_template=True)
        assert item.prompt_tokens.to_numpy().tolist() == rendered


def test_episodes_are_accepted_replayed_and_trained_on_their_sampled_ids_only(make):
    learner = make()
    lease_msg, rollouts, runner = run_episodes(learner)
    ack = ask(learner, A, rollouts)
    assert ack.status == "accepted", ack
    assert set(ack.groups.values()) == {"accepted"}
    groups = records(rollouts, lease_msg)
    read = learner.metrics.registry.get_sample_value
    completions = [c for g in groups for c in g.completions]
    assert read("grpo_fleet_learner_episode_tokens_total", {"kind": "sampled"}) == sum(c.sampled.sum() for c in completions)
    assert read("grpo_fleet_learner_episode_tokens_total", {"kind": "environment"}) == sum(
        (~c.sampled).sum() for c in completions)
    assert sum(read("grpo_fleet_learner_episodes_ended_total", {"end": end}) or 0
               for end in ("done", "max_turns", "budget")) == len(completions)
    batch = build_train_batch(groups)
    mask, targets, old = np.array(batch.mask), np.array(batch.targets), np.array(batch.old_logprobs)
    environment_tokens = 0
    for row, completion in enumerate(c for g in groups for c in g.completions):
        assert completion.mask is not None and completion.turns is not None
        sampled = runner.sampled[row]  # rows are group-major, as the runner's episode keys
        trained = targets[row][mask[row] != 0].tolist()
        assert trained == [t for turn in sampled for t in turn]  # the ids trained are the ids sampled
        start = len(groups[row // GROUP].prompt_tokens) - 1
        for turn, offset in zip(sampled, completion.turns):  # turn by turn, where the episode says they start
            assert targets[row, start + offset : start + offset + len(turn)].tolist() == turn
        environment = completion.mask == 0
        environment_tokens += int(environment.sum())
        assert not mask[row, start : start + len(completion.tokens)][environment].any()
        assert not old[row, start : start + len(completion.tokens)][environment].any()
    assert environment_tokens > 0  # the quiz answered some wrong first tries: there were observations to leave out


def test_environment_tokens_weigh_nothing_in_the_loss_the_kl_or_the_check(make):
    """The loss and KL are computed at the micro-batches' packed positions only, and the checks compare only where
    the batch's mask counts: no environment token is among them, and lies told there change no gap."""
    learner = make()
    lease_msg, rollouts, _ = run_episodes(learner)
    groups = records(rollouts, lease_msg)
    batch = build_train_batch(groups)
    mask = np.array(batch.mask)
    environment = np.zeros_like(mask, dtype=bool)
    for row, c in enumerate(x for g in groups for x in g.completions):
        assert c.mask is not None
        start = len(groups[row // GROUP].prompt_tokens) - 1
        environment[row, start : start + len(c.tokens)] = c.mask == 0
    assert environment.any()
    trained = np.zeros_like(mask, dtype=bool)
    for micro in split_batch(batch, learner.trainer.micro_batch_tokens):  # what the loss and the KL are taken over
        assert micro.rows is not None and micro.columns is not None
        on = np.array(micro.mask) != 0
        trained[np.broadcast_to(micro.rows[:, None], on.shape)[on], micro.columns[on]] = True
    assert not (trained & environment).any() and trained.sum() == mask.sum() == float(np.array(batch_totals(batch))[0])
    # The fused check: garbage at every environment position of the recomputed grid changes no gap.
    reported = np.array(batch.old_logprobs)
    bounds = np.full((len(groups), 2), 1.0, np.float32)
    honest = fused_check(reported, reported, mask, bounds)
    noisy = fused_check(np.where(environment, -99.0, reported), reported, mask, bounds)
    assert [(c.mean, c.worst) for c in honest] == [(c.mean, c.worst) for c in noisy] == [(0.0, 0.0)] * len(groups)
    # The forward check (verify/actor_checks.py LogprobCheck) on the learner's model: a lie at environment tokens
    # (records bypass the door, which refuses nonzero logprobs there) leaves every gap as it was.
    history = WeightHistory(learner.policy.model, keep=1)
    history.record(0)
    check = LogprobCheck(learner.policy.model, history, temperature=1.0, chunk_tokens=4096, micro_batch_tokens=4096)
    liars = records(rollouts, lease_msg)
    for group in liars:
        for c in group.completions:
            assert c.mask is not None
            c.logprobs = np.where(c.mask == 0, np.float32(-50.0), c.logprobs).astype(np.float32)
    before = [(g.mean, g.max) for g in check.gaps(groups) if g is not None]
    after = [(g.mean, g.max) for g in check.gaps(liars) if g is not None]
    assert before == after and len(before) == len(groups)
    assert max(worst for _, worst in before) < 1e-3  # honest episodes: the same logprobs the actor sampled with


def test_an_episode_in_a_single_turn_run_and_a_single_completion_in_an_episode_run_are_refused():
    tokens = m.Tensor.from_numpy(np.array([5, 6, 7], np.int32))
    logprobs = m.Tensor.from_numpy(np.array([-1.0, 0.0, -1.0], np.float32))
    episode = m.Completion(tokens=tokens, logprobs=logprobs, reward=1.0, finish_reason="length",
                           mask=m.Tensor.from_numpy(np.array([1, 0, 1], np.uint8)), turns=[0, 2], end="budget")
    single = m.Completion(tokens=tokens, logprobs=m.Tensor.from_numpy(np.full(3, -1.0, np.float32)), reward=0.0,
                          finish_reason="length")
    for completions, episodes, reason in (([episode, episode], None, RejectReason.EPISODE_MISMATCH),
                                          ([single, single], 64, RejectReason.EPISODE_MISMATCH),
                                          ([episode, episode], 2, RejectReason.TOO_LONG),
                                          ([episode, episode], 3, None), ([single, single], None, None)):
        msg = m.Rollouts(lease_id="l", policy_version=0, groups=[m.GroupResult(group_id="g", completions=completions)])
        assert m.validate_rollouts(msg, group_size=2, vocab_size=10, max_tokens=3,
                                   episode_tokens=episodes) is reason
    assert RejectReason.EPISODE_MISMATCH.is_violation and RejectReason.ENV_REPLAY_MISMATCH.is_violation


@pytest.mark.parametrize("ends", ["stop", "length"])
def test_an_episode_turn_longer_than_max_tokens_is_refused_as_too_long(ends):
    """Sampling ends a turn at generation.max_tokens; one longer that ends on its stop token (9) was accepted
    (issue 39, item 14)."""
    last = [5, 5, 5, 9] if ends == "stop" else [5, 5, 5]
    tokens = np.array([5, 5, 9, 1, *last], np.int32)  # the first turn fits (3), the last is 4 or 3 long
    mask = np.array([1, 1, 1, 0] + [1] * len(last), np.uint8)
    episode = m.Completion(tokens=m.Tensor.from_numpy(tokens),
                           logprobs=m.Tensor.from_numpy(np.where(mask == 1, -1.0, 0.0).astype(np.float32)),
                           reward=0.0, finish_reason=ends, mask=m.Tensor.from_numpy(mask), turns=[0, 4], end="done")
    msg = m.Rollouts(lease_id="l", policy_version=0, groups=[m.GroupResult(group_id="g", completions=[episode])])
    verdict = m.validate_rollouts(msg, group_size=1, vocab_size=10, max_tokens=3, stop_token_ids=frozenset({9}),
                                  episode_tokens=64)
    assert verdict is (RejectReason.TOO_LONG if ends == "stop" else None)
    assert RejectReason.TOO_LONG.is_violation  # counted in rejections_total{reason="too_long"} and toward a ban


@pytest.mark.parametrize("tokens, mask, reason, lie", [
    ([5, 9, 1, 5, 9], [1, 1, 0, 1, 1], "stop", False),  # two turns, each ended by its stop token (9)
    ([5, 5, 1, 5, 9], [1, 1, 0, 1, 1], "stop", False),  # the first turn cut at max_tokens (2)
    ([5, 1, 5, 9], [1, 0, 1, 1], "stop", True),  # the first turn neither stopped nor reached max_tokens
    ([9, 5, 1, 5, 9], [1, 1, 0, 1, 1], "stop", True),  # a stop token inside a turn
    ([5, 9, 1, 5, 5], [1, 1, 0, 1, 1], "length", False),  # the last turn cut at max_tokens
    ([5, 9, 1, 5, 5, 1, 5], [1, 1, 0, 1, 1, 0, 1], "length", False),  # the last turn cut by the budget (7)
    ([5, 9, 1, 5, 5, 1, 5], [1, 1, 0, 1, 1, 0, 1], "stop", True),  # "stop" without a stop token
    ([5, 9, 1, 5, 1, 5], [1, 1, 0, 1, 0, 1], "length", True),  # a middle turn cut short of max_tokens
    ([5, 9, 1, 5, 9], [1, 1, 0, 1, 1], "length", True),  # "length" that stopped
])
def test_an_episodes_finish_reason_is_checked_turn_by_turn(tokens, mask, reason, lie):
    found = m.episode_finish_mismatch(np.array(tokens), np.array(mask, np.uint8), reason, frozenset({9}),
                                      max_tokens=2, episode_tokens=7)
    assert found is lie


def test_records_keep_an_episodes_marks_through_a_checkpoint_and_truncation_is_per_episode(make):
    learner = make()
    lease_msg, rollouts, _ = run_episodes(learner)
    group = records(rollouts, lease_msg)[0]
    back = group_from_dict(group_to_dict(group))
    for before, after in zip(group.completions, back.completions):
        assert after.mask is not None and before.mask is not None
        assert np.array_equal(before.mask, after.mask) and after.turns == before.turns and after.end == before.end
        assert after.truncated == (after.end == "budget")
    cut = back.completions[0]
    cut.end = "budget"
    others = back.completions[1:]
    for c in others:
        c.end = "done"
    batch = build_train_batch([back], lengths=LengthShaping(max_tokens=BUDGET, mask_truncated=True))
    rows = np.array(batch.mask)
    assert not rows[0].any() and all(rows[i].any() for i in range(1, GROUP))


def test_message_limits_are_sized_from_the_episode_budget(tiny_chat_model_dir, tmp_path):
    small = inbound_limits(env_config(tiny_chat_model_dir, tmp_path))
    large = inbound_limits(env_config(tiny_chat_model_dir, tmp_path, task={"max_episode_tokens": 4 * BUDGET}))
    assert large.max_message_bytes - small.max_message_bytes >= 2 * GROUP * 9 * 3 * BUDGET
    rules = IntakeRules.from_config(env_config(tiny_chat_model_dir, tmp_path), vocab_size=100)
    assert rules.episode_tokens == BUDGET


def test_a_lying_episode_is_refused_as_a_replay_mismatch_and_counted(make):
    learner = make()
    lease_msg, rollouts, _ = run_episodes(learner)
    lied = []
    for group in rollouts.groups:
        completions = []
        for c in group.completions:
            assert c.mask is not None
            tokens = c.tokens.to_numpy().copy()
            mask = c.mask.to_numpy()
            if (mask == 0).any():  # an observation the environment never gave
                tokens[np.flatnonzero(mask == 0)[0]] = (tokens[np.flatnonzero(mask == 0)[0]] + 1) % 50
            completions.append(c.model_copy(update={"tokens": m.Tensor.from_numpy(tokens)}))
        lied.append(m.GroupResult(group_id=group.group_id, completions=completions))
    changed = [g for g, h in zip(lied, rollouts.groups) if g != h]
    assert changed, "no episode had an observation to alter"
    ack = ask(learner, A, rollouts.model_copy(update={"groups": lied}))
    statuses = {gid: status for gid, status in ack.groups.items()}
    assert all(statuses[g.group_id] == "invalid" for g in changed)
    assert rejections(learner, "env_replay_mismatch") == len(changed)


def test_a_reward_the_replay_does_not_give_is_refused(make):
    learner = make()
    _, rollouts, _ = run_episodes(learner)
    inflated = [m.GroupResult(group_id=g.group_id, completions=[c.model_copy(update={"reward": c.reward + 1.0})
                                                                for c in g.completions]) for g in rollouts.groups]
    ack = ask(learner, A, rollouts.model_copy(update={"groups": inflated}))
    assert set(ack.groups.values()) == {"invalid"}
    assert rejections(learner, "reward_mismatch") == len(inflated)


def test_a_run_that_verifies_rewards_refuses_an_environment_not_declared_deterministic(make, tmp_path):
    path = tmp_path / "coin.py"
    path.write_text(COIN_ENV)
    with pytest.raises(EnvNotVerifiable, match="verify_rewards = false"):
        make(task={"env": f"{path}:Coin"})
    learner = make(task={"env": f"{path}:Coin"}, security={"verify_rewards": False})
    assert hello(learner).env is not None


def test_the_learner_evaluates_held_out_episodes_itself_when_no_actor_is_connected(make):
    learner = make(train={"eval_every": 10, "eval_mode": "sampled", "eval_samples": 2})
    evaluator = LocalEvaluator(learner.cfg, learner.task, learner.policy, learner.lock, learner.state, learner.registry,
                               learner.evaluation, learner.trackers, InlineScorer, wait_seconds=0.0,
                               make_envs=InlineEnvs)
    try:
        assert learner.evaluation.current is not None  # the baseline round, waiting for an actor
        assert evaluator.run_if_needed()
    finally:
        evaluator.close()
    (line,) = [json.loads(x) for x in (learner.run_dir / "metrics.jsonl").read_text().splitlines()
               if '"eval"' in x]
    assert line["on_learner"] == line["scored"] == len(learner.task.eval) and line["dropped"] == 0
    assert 0.0 <= line["eval_reward"] <= 1.0  # the quiz's rewards: 1, 0.5 or 0 per episode


def test_samples_show_an_episode_turn_by_turn(make):
    learner = make()
    lease_msg, rollouts, runner = run_episodes(learner)
    groups = records(rollouts, lease_msg)
    decode = tokenizer_decode(learner.policy.tokenizer)
    rows = sample_rows(groups, [(g, c) for g in range(len(groups)) for c in range(GROUP)], 1, decode,
                       scale_by_std=True)
    many = [row for row in rows if len(row.turns) > 1]
    assert many, "no episode went past its first turn"
    for row, (g, c) in zip(rows, [(g, c) for g in range(len(groups)) for c in range(GROUP)]):
        completion = groups[g].completions[c]
        assert [text for who, text in row.turns if who == "model"] == [decode(np.array(t))
                                                                       for t in runner.sampled[g * GROUP + c]]
        assert "".join(text for _, text in row.turns) == row.completion and row.end == completion.end
    back = row_from_json(json.dumps(dataclasses.asdict(many[0])))
    assert back == many[0]
    shown = format_row(many[0], width=200, max_chars=10_000)
    assert "turn 1 (model):" in shown and "turn 2 (model):" in shown and "environment:" in shown
    assert f"episode ended: {many[0].end}" in shown


def test_the_quiz_demo_is_one_packaged_config_of_the_real_model(tmp_path):
    cfg = RunConfig.model_validate(demo_settings(DemoOptions(model="smollm2-135m-instruct", config="capital-quiz")))
    assert cfg.task.env == f"{QUIZ}:CapitalQuiz" and cfg.task.rewards == [] and cfg.security.verify_rewards
    assert Path(cfg.task.train_path or "").is_file() and cfg.model.path == "zoo:smollm2-135m-instruct"
    with pytest.raises(ZooError, match="no packaged demo"):
        demo_settings(DemoOptions(model="smollm2-135m-instruct", config="no-such-demo"))


def test_logged_advantages_of_episodes_are_the_ones_the_step_trains_on(make):
    """The overlong penalty counts an episode's sampled tokens, in the step and in samples.jsonl alike."""
    learner = make()
    lease_msg, rollouts, _ = run_episodes(learner)
    groups = records(rollouts, lease_msg)
    shaping = LengthShaping(max_tokens=2 * MAX_TOKENS, overlong_buffer=MAX_TOKENS, overlong_penalty=1.0)
    assert any(int(c.sampled.sum()) > MAX_TOKENS for g in groups for c in g.completions)  # some are penalised
    batch = build_train_batch(groups, lengths=shaping)
    picked = [(g, c) for g in range(len(groups)) for c in range(GROUP)]
    rows = sample_rows(groups, picked, 1, tokenizer_decode(learner.policy.tokenizer), scale_by_std=True,
                       lengths=shaping)
    assert [row.advantage for row in rows] == pytest.approx(np.array(batch.advantages).tolist(), abs=1e-5)

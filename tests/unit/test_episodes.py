"""Episodes, token in and token out: ids extended turn by turn, masks, end reasons, failures (issue 28)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from grpo_fleet.actor import wire
from grpo_fleet.actor.episodes import score_episodes
from grpo_fleet.actor.rewarding import RunRewards
from grpo_fleet.envs.hosting import EnvAnswer, EnvCalls, InlineEnvs
from grpo_fleet.envs.protocol import env_extras
from grpo_fleet.envs.runner import EpisodeLimits, EpisodeOutcome, EpisodeRunner, EpisodeStart
from grpo_fleet.envs.template import ObservationEncoder
from grpo_fleet.learner.step.objective import policy_logprobs
from grpo_fleet.models.generation import SamplingSettings, encode_prompt
from grpo_fleet.models.loading import load_policy
from grpo_fleet.observe.metrics import actor_metrics
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import decode, encode
from grpo_fleet.tasks.env_module import EnvSetup
from grpo_fleet.tasks.prompts import chat_messages, decode_completion
from grpo_fleet.tasks.reward_runner import InlineScorer, RewardSet

QUIZ = "grpo_fleet.envs.capital_quiz"
SYSTEM = "Answer in one short sentence."
QUESTIONS = [("What is the capital of Kenya?", "Nairobi"), ("What is the capital of Peru?", "Lima")]

# A user's environment, written as a stranger would: no grpo_fleet import. It answers every turn with a numbered
# observation, never says done, and fails on demand.
ECHO_ENV = '''
class Echo:
    def __init__(self, env_config, extras):
        self.fail_at = int(env_config.get("fail_at", 0))
        self.answer = extras["reward_spec"]["ground_truth"]
        self.turn = 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.turn += 1
        if self.turn == self.fail_at:
            raise RuntimeError("the environment broke")
        return {"observations": [{"role": "user", "content": f"turn {self.turn} seen"}], "reward": 0.25,
                "done": False, "metadata": {}}
'''


class Recording:
    """A real host, whose calls and answers the test reads afterwards. `hold`: episode k's answers come back only
    after k % (hold + 1) more collects, as slow tools would, so episodes park and resume in a mixed order."""

    def __init__(self, envs: InlineEnvs, hold: int = 0) -> None:
        self.envs, self.hold = envs, hold
        self.log: list[tuple[Any, EnvAnswer]] = []
        self.held: list[tuple[int, EnvAnswer]] = []  # (the collect that releases it, the answer)
        self.collects = 0

    def run_envs(self, calls: EnvCalls) -> list[EnvAnswer]:
        answers = self.envs.run_envs(calls)
        self.log.extend(zip(calls.calls, answers))
        return answers

    def submit(self, calls: EnvCalls) -> None:
        self.held += [(self.collects + 1 + a.episode % (self.hold + 1), a) for a in self.run_envs(calls)]

    def collect(self, wait_seconds: float = 0.0) -> list[EnvAnswer]:
        self.collects += 1
        due = [answer for when, answer in self.held if when <= self.collects]
        self.held = [(when, answer) for when, answer in self.held if when > self.collects]
        return due


@pytest.fixture(scope="module")
def policy(tiny_chat_model_dir: Path) -> Any:
    return load_policy(str(tiny_chat_model_dir))


def _starts(policy: Any) -> list[EpisodeStart]:
    return [EpisodeStart(encode_prompt(policy.tokenizer, q, chat_template=True, system_prompt=SYSTEM),
                         chat_messages(q, SYSTEM), env_extras({}, a, 3)) for q, a in QUESTIONS]


def _run(policy: Any, setup: EnvSetup, *, group_size: int = 3, max_tokens: int = 6,
         budget: int = 200, hold: int = 0, stop: bool = True) -> tuple[list[list[EpisodeOutcome]], Recording]:
    mx.random.seed(7)
    settings = SamplingSettings(group_size=group_size, max_tokens=max_tokens, temperature=1.0,
                                stop_token_ids=sorted(policy.tokenizer.eos_token_ids) if stop else [])
    recording = Recording(InlineEnvs(setup), hold)
    runner = EpisodeRunner(policy.model, policy.tokenizer, settings, EpisodeLimits(setup.max_turns, budget), recording)
    return runner.run(_starts(policy)), recording


def _echo_setup(tmp_path: Path, **config: Any) -> EnvSetup:
    path = tmp_path / "echo_env.py"
    path.write_text(ECHO_ENV)
    return EnvSetup(module=str(path), class_name="Echo", config=config, max_turns=3)


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, kind) of each run of equal mask values."""
    edges = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
    return [(a, b, mask[a]) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("hold", [0, 3])  # 3: observations come back late and out of order, episodes parked meanwhile
def test_ids_are_the_sampled_turns_and_the_template_differences(policy: Any, tmp_path: Path, hold: int) -> None:
    groups, recording = _run(policy, _echo_setup(tmp_path), hold=hold)
    encoder = ObservationEncoder(policy.tokenizer, policy.tokenizer.eos_token_ids)
    eos = set(policy.tokenizer.eos_token_ids)
    steps = [(call, answer) for call, answer in recording.log if call.kind == "step"]
    for index, group in enumerate(groups):
        for j, outcome in enumerate(group):
            completion, marks = outcome.completion, outcome.completion.episode
            assert marks is not None and marks.end == "max_turns" and outcome.turns == 3
            key = index * len(group) + j
            mine = [(c, a) for c, a in steps if c.episode == key]
            conversation = chat_messages(QUESTIONS[index][0], SYSTEM)
            sampled = [s for s in _spans(marks.mask) if s[2] == 1]
            chunks = [s for s in _spans(marks.mask) if s[2] == 0]
            assert [s[0] for s in sampled] == marks.turns and len(sampled) == len(mine) == 3 and len(chunks) == 2
            for turn, ((call, answer), (start, end, _)) in enumerate(zip(mine, sampled)):
                ids = completion.tokens[start:end]
                # What the environment was given is these very ids, decoded once: nothing re-tokenized.
                finish = "stop" if ids[-1] in eos else "length"
                assert call.payload == decode_completion(policy.tokenizer, ids, finish, eos)
                if turn < 2:  # the chunk after it is the template's difference, tokenized alone
                    chunk_start, chunk_end, _ = chunks[turn]
                    assert chunk_start == end
                    assert answer.step is not None
                    expected = encoder.chunk(conversation, ids[-1], answer.step.observations)
                    assert completion.tokens[chunk_start:chunk_end] == expected
                    conversation = [*conversation, {"role": "assistant", "content": call.payload},
                                    *answer.step.observations]
            assert outcome.reward == pytest.approx(0.75)  # the sum of three steps' 0.25


@pytest.mark.parametrize("hold", [0, 3])
def test_sampled_logprobs_are_the_learners_on_the_whole_episode(policy: Any, tmp_path: Path, hold: int) -> None:
    # The learner recomputes every logprob from prompt + completion in one forward: sampled tokens agree with what
    # the actor recorded while resuming from KV caches (parked beside the batch while others decode, with `hold`);
    # environment tokens carry 0 and no claim. No stop tokens: every turn is max_tokens long, so without `hold` the
    # episodes take their turns in step whatever was sampled.
    groups, recording = _run(policy, _echo_setup(tmp_path), hold=hold, stop=False)
    resumed = [call.episode for call, _ in recording.log if call.kind == "step"]
    in_step = [key for _ in range(3) for key in sorted(set(resumed))]  # every episode's turn t before any's t + 1
    assert (resumed == in_step) == (hold == 0), "held answers must make the episodes take their turns out of step"
    starts = _starts(policy)
    for start, group in zip(starts, groups):
        for outcome in group:
            ids = start.prompt_tokens + outcome.completion.tokens
            recomputed = policy_logprobs(policy.model, mx.array([ids[:-1]]), mx.array([ids[1:]]), 1.0)
            learner = np.array(recomputed)[0][len(start.prompt_tokens) - 1:]
            mask = np.array(outcome.completion.episode.mask) == 1
            actor = np.array(outcome.completion.logprobs)
            assert np.max(np.abs(learner[mask] - actor[mask])) < 1e-4
            assert np.all(actor[~mask] == 0.0) and (~mask).sum() > 0


def test_an_episode_ends_when_done_or_out_of_budget(policy: Any, tmp_path: Path) -> None:
    quiz = EnvSetup(module=QUIZ, class_name="CapitalQuiz", config={"tries": 1}, max_turns=3)
    groups, _ = _run(policy, quiz)
    ends = {o.completion.episode.end for g in groups for o in g}
    assert ends == {"done"} and all(o.turns == 1 for g in groups for o in g)
    groups, _ = _run(policy, _echo_setup(tmp_path), budget=12, max_tokens=6)
    for outcome in (o for g in groups for o in g):
        assert outcome.completion.episode.end == "budget" and len(outcome.completion.tokens) <= 12


def test_a_failing_environment_sends_its_group_back_unscored(policy: Any, tmp_path: Path) -> None:
    groups, _ = _run(policy, _echo_setup(tmp_path, fail_at=2))
    assert all(any(o.failure is not None for o in g) for g in groups)
    failure = next(o.failure for o in groups[0] if o.failure is not None)
    assert failure.kind == "exception" and "the environment broke" in failure.detail
    items = [m.PromptItem(group_id=f"g{i}", prompt_index=i, prompt_tokens=m.Tensor.from_numpy(np.array([1], np.int32)),
                          fields={"answer": a}) for i, (_, a) in enumerate(QUESTIONS)]
    scored, unscored = score_episodes(items, groups, RunRewards(), policy.tokenizer, actor_metrics())
    assert scored == [] and [u.group_id for u in unscored] == ["g0", "g1"]
    assert {(u.reward, u.error) for u in unscored} == {("env", "exception")}


def test_scored_episodes_travel_with_mask_turns_and_end(policy: Any, tmp_path: Path) -> None:
    groups, _ = _run(policy, _echo_setup(tmp_path))
    rewards = RunRewards()
    rewards.rewards = RewardSet(names=("language_consistency",), weights=(1.0,))  # the task's rewards add up too
    rewards.scorer = InlineScorer(rewards.rewards)
    items = [m.PromptItem(group_id=f"g{i}", prompt_index=i, prompt_tokens=m.Tensor.from_numpy(np.array([1], np.int32)),
                          fields={"answer": a}) for i, (_, a) in enumerate(QUESTIONS)]
    scored, unscored = score_episodes(items, groups, rewards, policy.tokenizer, actor_metrics())
    assert unscored == [] and len(scored) == 2
    message = decode(encode(m.Rollouts(lease_id="l", policy_version=0, groups=scored)))
    assert isinstance(message, m.Rollouts)
    completion = message.groups[0].completions[0]
    outcome = groups[0][0]
    assert completion.mask is not None and completion.mask.to_numpy().tolist() == outcome.completion.episode.mask
    assert completion.turns == outcome.completion.episode.turns and completion.end == "max_turns"
    transcript = policy.tokenizer.decode(outcome.completion.tokens)  # the task's reward sees both kinds of tokens
    share = sum(" " <= ch <= "~" or ch in "\n\t" for ch in transcript) / len(transcript)
    assert completion.reward == pytest.approx(0.75 + share, abs=1e-5)  # the episode's reward plus the task's
    assert wire.to_completion(outcome.completion, 1.0).tokens.to_numpy().tolist() == outcome.completion.tokens

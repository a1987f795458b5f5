"""Verified episodes: a deterministic environment replayed on the learner with the actions an episode reports.

An episode's reward comes from the environment, which runs on the actor. The
learner can check it only by running the environment itself: an environment
that declares itself deterministic (a class attribute `deterministic = True`:
the same actions always give the same observations and rewards) is built again
here for every submitted episode, fed the episode's own sampled turns, decoded
exactly as the actor decoded them, and must give back the very observation
tokens the episode holds and its reward. Any difference is the actor's lie (or
a non-deterministic environment that claimed otherwise): `env_replay_mismatch`.

What a replay may cost, and who pays. The environment runs in a child process
of the learner (envs/process.py, on runtime/child.py's guarded child), never in
the learner's own, so a hang or a crash costs a killed child, not the learner. Once the environment has the
actor's turns, the replay has security.replay_seconds for the group (every
episode, every turn, the comparison included; rendering each turn's history
makes that grow with the square of the turns): past it, or past a call's
task.env_timeout_seconds, the group is refused as `env_replay_timeout` and the
actor charged a violation, as for a reward that times out on its completions
(the actor says its own run of the same environment on the same turns finished).
The environment raising or dying on a turn is the actor's too (it would have
on the actor, and the episode would have failed there): `env_replay_mismatch`.
Only env.init, which sees nothing of the actor's, is the learner's to answer
for: its failure is `reward_unverifiable`. The prompt of a refused group goes
back, to another actor, at most a few times (learner/door/intake.py). Stopping
the learner kills the child, so a replay in flight ends at once.

An environment that does not declare itself deterministic cannot be checked
this way, so a run with security.verify_rewards on refuses to start with one
(`check_verifiable`); with it off, episodes' rewards are trusted as reported.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from grpo_fleet.envs.hosting import EnvAnswer, EnvCall, EnvCalls
from grpo_fleet.envs.protocol import env_extras
from grpo_fleet.envs.template import ObservationEncoder, TemplateError
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.messages import turn_spans
from grpo_fleet.tasks import Example, reward_kwargs
from grpo_fleet.tasks.env_module import EnvSetup, load_env_class
from grpo_fleet.tasks.prompts import chat_messages, decode_completion


class EnvNotVerifiable(ValueError):
    """security.verify_rewards is on but the environment does not declare itself deterministic."""


class EnvCalling(Protocol):
    """Runs batches of environment calls: envs.process.EnvProcess (a child process, which a batch's deadline or
    `close` from another thread can stop), or envs.hosting.InlineEnvs (tests and benches: neither can)."""

    def run_envs(self, calls: EnvCalls, max_seconds: Optional[float] = None) -> list[EnvAnswer]: ...

    def close(self) -> None: ...


def is_deterministic(setup: EnvSetup) -> bool:
    """Whether the environment's class says `deterministic = True` (only that exact value counts)."""
    return getattr(load_env_class(setup.module, setup.class_name), "deterministic", False) is True


def check_verifiable(setup: Optional[EnvSetup], verify_rewards: bool) -> None:
    """Refuse a run that would verify rewards it cannot: an environment the learner cannot replay."""
    if setup is None or not verify_rewards or is_deterministic(setup):
        return
    raise EnvNotVerifiable(
        f"task.env {setup.class_name} does not declare itself deterministic (a class attribute "
        "`deterministic = True`), so the learner cannot replay its episodes to check their rewards. Either make it "
        "deterministic and say so, or trust the actors' episode rewards with security.verify_rewards = false "
        "(only with actors you trust)")


@dataclass(frozen=True)
class Replayed:
    """An episode replayed: its reward, or why it has none (at most one of the three reasons is set)."""

    reward: float = 0.0
    problem: str = ""  # the observations, the episode's end, or the environment's failing differ from the actor's
    overran: str = ""  # the actor's turns held the replay past a call's timeout or security.replay_seconds
    failed: str = ""  # the environment failed here before any of the actor's turns (or the learner is stopping)


def _failure(answer: EnvAnswer, stopping: bool, turn: int) -> Replayed:
    """Why an environment call on one of the actor's turns gave no step, and whose fault that is."""
    said = f"turn {turn}: {answer.failure}: {answer.detail}"
    if stopping or answer.failure == "lost":
        return Replayed(failed=said)
    if answer.failure == "timeout":
        return Replayed(overran=said)
    # It raised, broke the interface or killed its process on this action: it would have on the actor too, whose
    # episode would then have failed, not been scored.
    return Replayed(problem=f"the environment failed on {said}")


class EnvReplay:
    """Replays a group's episodes of a deterministic environment: two batches of environment calls (every
    episode's init, then every episode's turns and close), in `envs`' process; the second, and the comparison
    after it, within `budget_seconds` (security.replay_seconds), which the submitting actor is charged for."""

    def __init__(self, setup: EnvSetup, tokenizer: Any, system_prompt: Optional[str], envs: EnvCalling,
                 budget_seconds: float = float("inf")) -> None:
        self.setup, self.tokenizer, self.system_prompt, self.envs = setup, tokenizer, system_prompt, envs
        self.budget_seconds = budget_seconds
        self.eos = {int(t) for t in tokenizer.eos_token_ids}
        self.encoder = ObservationEncoder(tokenizer, self.eos)
        self.stopping = False
        self._serial = 0

    def replay_group(self, example: Example, completions: Sequence[m.Completion]) -> list[Replayed]:
        """Each completion of one group, replayed from env.init with its own actions."""
        keys = list(range(self._serial + 1, self._serial + len(completions) + 1))
        self._serial += len(completions)
        columns = {k: v for k, v in reward_kwargs(example).items() if k != "answer"}
        messages = chat_messages(example.prompt, self.system_prompt)
        extras = env_extras(columns, example.answer, self.setup.max_turns)
        episodes = [(key, c) for key, c in zip(keys, completions) if c.mask is not None and c.turns is not None]
        # The prompt is the learner's: nothing the actor sent has reached the environment yet.
        inits = self.envs.run_envs(EnvCalls([EnvCall(key, "init", (extras, messages)) for key, _ in episodes]),
                                   self.budget_seconds)
        opened = {a.episode: a.conversation for a in inits if a.failure is None and a.conversation is not None}
        calls = [call for key, c in episodes if key in opened for call in self._turn_calls(key, c)]
        deadline = time.monotonic() + self.budget_seconds  # from here on, the actor's turns cost the time
        answers: dict[int, list[EnvAnswer]] = {}
        for answer in self.envs.run_envs(EnvCalls(calls), self.budget_seconds) if calls else []:
            answers.setdefault(answer.episode, []).append(answer)
        failed = {a.episode: f"init: {a.failure}: {a.detail}" for a in inits if a.episode not in opened}
        return [self._judge(key, c, messages, opened, failed, answers, deadline) for key, c in zip(keys, completions)]

    def stop(self) -> None:
        """The learner is stopping: end a replay in flight now (from any thread); every one after fails at once."""
        self.stopping = True
        self.envs.close()

    def _turn_calls(self, key: int, completion: m.Completion) -> list[EnvCall]:
        return [*(EnvCall(key, "step", action) for _, action in self._actions(completion)), EnvCall(key, "close")]

    def _actions(self, completion: m.Completion) -> list[tuple[list[int], str]]:
        """Each sampled turn's ids, and its text decoded exactly as the actor decoded it."""
        tokens = completion.tokens.to_numpy().astype(np.int64).tolist()
        assert completion.mask is not None
        starts, stops = turn_spans(completion.mask.to_numpy())
        actions = []
        for start, stop in zip(starts.tolist(), stops.tolist()):
            ids = tokens[start:stop]
            finish = "stop" if ids[-1] in self.eos else "length"
            actions.append((ids, decode_completion(self.tokenizer, ids, finish, self.eos)))
        return actions

    def _judge(self, key: int, completion: m.Completion, messages: list[dict[str, Any]],
               opened: dict[int, Any], failed: dict[int, str], answers: dict[int, list[EnvAnswer]],
               deadline: float) -> Replayed:
        if completion.mask is None or completion.turns is None:
            return Replayed(problem="not an episode")
        if key not in opened:
            return Replayed(failed=failed.get(key, "init: no answer"))
        return self._turns(opened[key], messages, completion, answers.get(key, []), deadline)

    def _turns(self, conversation: list[dict[str, Any]], messages: list[dict[str, Any]], completion: m.Completion,
               steps: list[EnvAnswer], deadline: float) -> Replayed:
        tokens = completion.tokens.to_numpy().astype(np.int64).tolist()
        turns = list(completion.turns or [])
        prompt = self.encoder.prompt_ids(messages)
        first = self.encoder.prompt_ids(conversation)
        if first[: len(prompt)] != prompt or first[len(prompt):] != tokens[: turns[0]]:
            return Replayed(problem="the tokens before the first turn are not what env.init gives")
        reward = 0.0
        for index, ((action_ids, action), answer) in enumerate(zip(self._actions(completion), steps)):
            if answer.failure is not None or answer.step is None:
                return _failure(answer, self.stopping, index + 1)
            if time.monotonic() > deadline:  # rendering every turn's history costs the square of the turns
                return Replayed(overran=f"turn {index + 1}: past security.replay_seconds ({self.budget_seconds:g}s)")
            reward += answer.step.reward
            last = index == len(turns) - 1
            if answer.step.done or last:
                return self._ended(reward, answer.step.done, last, len(turns), completion.end)
            try:
                chunk = self.encoder.chunk(conversation, action_ids[-1], answer.step.observations)
            except TemplateError as exc:
                return Replayed(failed=str(exc))
            stop = turns[index] + len(action_ids)
            if chunk != tokens[stop : turns[index + 1]]:
                return Replayed(problem=f"turn {index + 1}'s observation tokens are not what the environment gives")
            conversation = [*conversation, {"role": "assistant", "content": action}, *answer.step.observations]
        return Replayed(failed="the environment answered fewer turns than the episode holds")

    def _ended(self, reward: float, done: bool, last: bool, turns: int, end: str) -> Replayed:
        """The episode stops here: it must say why as the environment and the run's limits do."""
        if done and not last:
            return Replayed(problem="the environment said done before the episode's last turn")
        if done and end != "done":
            return Replayed(problem=f"the environment said done, but the episode ended by {end!r}")
        if not done and end == "done":
            return Replayed(problem="the episode claims done, but the environment did not say so")
        if end == "max_turns" and turns < self.setup.max_turns:
            return Replayed(problem=f"ended by max_turns after {turns} turns (task.max_turns {self.setup.max_turns})")
        return Replayed(reward=reward)

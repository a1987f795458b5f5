"""Verified episodes: a deterministic environment replayed on the learner with the actions an episode reports.

An episode's reward comes from the environment, which runs on the actor. The
learner can check it only by running the environment itself: an environment
that declares itself deterministic (a class attribute `deterministic = True`:
the same actions always give the same observations and rewards) is built again
here for every submitted episode, fed the episode's own sampled turns, decoded
exactly as the actor decoded them, and must give back the very observation
tokens the episode holds and its reward. Any difference is the actor's lie (or
a non-deterministic environment that claimed otherwise): `env_replay_mismatch`.

An environment that does not declare itself deterministic cannot be checked
this way, so a run with security.verify_rewards on refuses to start with one
(`replay_for`); with it off, episodes' rewards are trusted as reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np

from grpo_fleet.envs.hosting import EnvAnswer, EnvCall, EnvCalls
from grpo_fleet.envs.protocol import env_extras
from grpo_fleet.envs.template import ObservationEncoder, TemplateError
from grpo_fleet.protocol import messages as m
from grpo_fleet.tasks import Example, reward_kwargs
from grpo_fleet.tasks.env_module import EnvSetup, load_env_class
from grpo_fleet.tasks.prompts import chat_messages, decode_completion


class EnvNotVerifiable(ValueError):
    """security.verify_rewards is on but the environment does not declare itself deterministic."""


class EnvCalling(Protocol):
    """Runs batches of environment calls: envs.hosting.InlineEnvs, or envs.process.EnvProcess (a child process)."""

    def run_envs(self, calls: EnvCalls) -> list[EnvAnswer]: ...


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
    """An episode replayed: its reward, or what differs from the actor's account (then no reward)."""

    reward: float = 0.0
    problem: str = ""  # set: the observations or the episode's end do not match the environment's
    failed: str = ""  # set: the environment failed here (raised, timed out): unverifiable, not the actor's fault


class EnvReplay:
    """Replays episodes of a deterministic environment, one environment call batch per turn of a group."""

    def __init__(self, setup: EnvSetup, tokenizer: Any, system_prompt: Optional[str], envs: EnvCalling) -> None:
        self.setup, self.tokenizer, self.system_prompt, self.envs = setup, tokenizer, system_prompt, envs
        self.eos = {int(t) for t in tokenizer.eos_token_ids}
        self.encoder = ObservationEncoder(tokenizer, self.eos)
        self._serial = 0

    def replay_group(self, example: Example, completions: Sequence[m.Completion]) -> list[Replayed]:
        """Each completion of one group, replayed from env.init with its own actions."""
        return [self._replay(example, completion) for completion in completions]

    def _replay(self, example: Example, completion: m.Completion) -> Replayed:
        if completion.mask is None or completion.turns is None:
            return Replayed(problem="not an episode")
        self._serial += 1
        key = self._serial
        columns = {k: v for k, v in reward_kwargs(example).items() if k != "answer"}
        messages = chat_messages(example.prompt, self.system_prompt)
        extras = env_extras(columns, example.answer, self.setup.max_turns)
        (answer,) = self.envs.run_envs(EnvCalls([EnvCall(key, "init", (extras, messages))]))
        if answer.failure is not None or answer.conversation is None:
            return Replayed(failed=f"init: {answer.failure}: {answer.detail}")
        try:
            return self._turns(key, answer.conversation, messages, completion)
        finally:
            self.envs.run_envs(EnvCalls([EnvCall(key, "close")]))

    def _turns(self, key: int, conversation: list[dict[str, Any]], messages: list[dict[str, Any]],
               completion: m.Completion) -> Replayed:
        tokens = completion.tokens.to_numpy().astype(np.int64).tolist()
        mask = completion.mask.to_numpy() if completion.mask is not None else np.ones(len(tokens), np.uint8)
        turns = list(completion.turns or [])
        prompt = self.encoder.prompt_ids(messages)
        first = self.encoder.prompt_ids(conversation)
        if first[: len(prompt)] != prompt or first[len(prompt):] != tokens[: turns[0]]:
            return Replayed(problem="the tokens before the first turn are not what env.init gives")
        reward = 0.0
        for index, start in enumerate(turns):
            stop = start + int(np.argmin(np.append(mask[start:], 0)))  # the end of this sampled run
            action_ids = tokens[start:stop]
            finish = "stop" if action_ids[-1] in self.eos else "length"
            action = decode_completion(self.tokenizer, action_ids, finish, self.eos)
            (answer,) = self.envs.run_envs(EnvCalls([EnvCall(key, "step", action)]))
            if answer.failure is not None or answer.step is None:
                return Replayed(failed=f"step: {answer.failure}: {answer.detail}")
            reward += answer.step.reward
            last = index == len(turns) - 1
            if answer.step.done or last:
                return self._ended(reward, answer.step.done, last, len(turns), completion.end)
            try:
                chunk = self.encoder.chunk(conversation, action_ids[-1], answer.step.observations)
            except TemplateError as exc:
                return Replayed(failed=str(exc))
            if chunk != tokens[stop : turns[index + 1]]:
                return Replayed(problem=f"turn {index + 1}'s observation tokens are not what the environment gives")
            conversation = [*conversation, {"role": "assistant", "content": action}, *answer.step.observations]
        return Replayed(problem="no turns")  # unreachable: a valid episode has at least one

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

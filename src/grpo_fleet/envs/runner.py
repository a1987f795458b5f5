"""The actor's episode runner: G episodes per prompt, turn by turn, token in and token out.

Each episode's ids are the prompt's, then its turns as sampled, then after each
turn the environment's chunk (envs/template.py), and so on; nothing is ever
re-tokenized. The mask says which ids the model sampled (1) and which the
environment gave (0); only sampled ones carry logprobs. All episodes of a lease
share one continuous batch (generation.TurnGenerator). A turn that ends leaves
the batch, its KV cache parked beside it, and its environment step is sent off
without waiting (`submit`): the other sequences keep decoding, and a sequence
waiting for a slot takes the freed one. When the observation comes back
(`collect`, between decoding steps), the episode re-enters the batch from its
cache with the observation's ids. A slow tool holds its own episode only; an
episode's turns, ids and masks are those of a sequential run.

An episode ends when its environment says done, after task.max_turns turns, or
when the next observation would not fit in task.max_episode_tokens (the tokens
after the prompt, both kinds). Its reward is the sum of its steps' rewards. An
environment that fails (raises, hangs, breaks the interface) fails its episode,
and the actor sends that group back unscored, as with a failing reward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import mlx.nn as nn

from grpo_fleet.envs.hosting import EnvAnswer, EnvCall, EnvCalls
from grpo_fleet.envs.template import ObservationEncoder, TemplateError
from grpo_fleet.models.generation import EpisodeMarks, GeneratedCompletion, SamplingSettings, TurnEnd, TurnGenerator
from grpo_fleet.tasks.prompts import decode_completion


class EnvRunner(Protocol):
    """Runs environment calls: the environment process on an actor (envs/process.EnvProcess), or InlineEnvs."""

    def run_envs(self, calls: EnvCalls) -> list[EnvAnswer]: ...

    def submit(self, calls: EnvCalls) -> None: ...

    def collect(self, wait_seconds: float = 0.0) -> list[EnvAnswer]: ...


# How long the runner waits for an observation when no sequence is decoding (every episode left waits for its tool).
ENV_WAIT_SECONDS = 0.05


@dataclass
class SlotUse:
    """Decoding slots over time: how many there were for the episodes still running, and how many sat idle."""

    slot_seconds: float = 0.0
    idle_slot_seconds: float = 0.0
    tool_wait_seconds: float = 0.0  # time with at least one episode waiting for its environment
    _last: float = field(default_factory=time.perf_counter)

    def observe(self, capacity: int, decoding: int, unfinished: int, waiting: int) -> None:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        slots = min(capacity, unfinished)
        if slots:
            self.slot_seconds += slots * elapsed
            self.idle_slot_seconds += max(0, slots - decoding) * elapsed
        if waiting:
            self.tool_wait_seconds += elapsed

    @property
    def idle_share(self) -> float:
        return self.idle_slot_seconds / self.slot_seconds if self.slot_seconds else 0.0


@dataclass(frozen=True)
class EpisodeStart:
    """One prompt: the learner's prompt ids, the conversation they render (for env.init), the env's extras."""

    prompt_tokens: list[int]
    messages: list[dict[str, Any]]
    extras: dict[str, Any]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_episode_tokens: int


@dataclass(frozen=True)
class EnvFailure:
    """Why an episode failed: the environment's error kind (hosting.FailureKind, "init", "template") and detail."""

    kind: str
    detail: str


@dataclass
class EpisodeOutcome:
    """A finished episode: its completion (every id after the prompt, with marks), reward, turns, env seconds."""

    completion: GeneratedCompletion
    reward: float
    turns: int
    env_seconds: float
    failure: Optional[EnvFailure] = None


@dataclass
class _Episode:
    key: int
    group: int
    conversation: list[dict[str, Any]] = field(default_factory=list)  # what the template renders, turn by turn
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    reward: float = 0.0
    env_seconds: float = 0.0
    finish_reason: str = "stop"
    end: Optional[str] = None
    failure: Optional[EnvFailure] = None
    opened: bool = False  # init succeeded: the host holds an environment to close

    def add(self, tokens: list[int], logprobs: Optional[list[float]] = None) -> None:
        """Append sampled ids (with their logprobs) or environment ids (without)."""
        if logprobs is not None:
            self.turns.append(len(self.tokens))
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        self.mask.extend([1 if logprobs is not None else 0] * len(tokens))

    def outcome(self) -> EpisodeOutcome:
        marks = EpisodeMarks(mask=self.mask, turns=self.turns, end=self.end or "done")
        completion = GeneratedCompletion(tokens=self.tokens, logprobs=self.logprobs, finish_reason=self.finish_reason,
                                         episode=marks)
        return EpisodeOutcome(completion, self.reward, len(self.turns), self.env_seconds, self.failure)


class EpisodeRunner:
    """Runs the episodes of one lease: init, turns and steps, close."""

    def __init__(self, model: nn.Module, tokenizer: Any, settings: SamplingSettings, limits: EpisodeLimits,
                 envs: EnvRunner, *, batch_size: int = 64, on_step: Optional[Callable[[], None]] = None) -> None:
        self.model, self.tokenizer, self.settings, self.limits, self.envs = model, tokenizer, settings, limits, envs
        self.batch_size, self.on_step = batch_size, on_step
        self.slots = SlotUse()  # of the last `run`
        self.eos = {int(t) for t in settings.stop_token_ids}
        self.encoder = ObservationEncoder(tokenizer, self.eos)

    def run(self, starts: list[EpisodeStart]) -> list[list[EpisodeOutcome]]:
        size = self.settings.group_size
        episodes = [_Episode(key=i * size + j, group=i) for i in range(len(starts)) for j in range(size)]
        prompts = self._init(episodes, starts)
        capacity = min(len(episodes), self.batch_size)
        generator = TurnGenerator(self.model, self.settings, capacity)
        waiting: dict[int, tuple[TurnEnd, str]] = {}  # episodes whose environment is stepping: the turn and its text
        try:
            ready = [e for e in episodes if e.failure is None]
            generator.start([e.key for e in ready], [prompts[e.key] for e in ready],
                            [self._room(e) for e in ready])
            self.slots = SlotUse()
            while generator.active or waiting:
                if generator.active:
                    self._send_steps(episodes, generator.next_ends(self.on_step, one_step=True), waiting)
                for answer in self.envs.collect(0.0 if generator.active else ENV_WAIT_SECONDS):
                    self._resume(episodes, answer, waiting, generator)
                self.slots.observe(capacity, generator.decoding, generator.decoding + len(waiting), len(waiting))
        finally:
            generator.close()
            self._close(episodes)
        outcomes = [e.outcome() for e in episodes]
        return [outcomes[i : i + size] for i in range(0, len(outcomes), size)]

    def _room(self, episode: _Episode) -> int:
        return min(self.settings.max_tokens, self.limits.max_episode_tokens - len(episode.tokens))

    def _init(self, episodes: list[_Episode], starts: list[EpisodeStart]) -> dict[int, list[int]]:
        """env.init for every episode; the ids each first turn is generated from (the learner's prompt, plus any
        messages init appended, as environment ids)."""
        calls = [EnvCall(e.key, "init", (dict(starts[e.group].extras), [dict(m) for m in starts[e.group].messages]))
                 for e in episodes]
        prompts = {}
        for episode, answer in zip(episodes, self.envs.run_envs(EnvCalls(calls))):
            episode.env_seconds += answer.seconds
            if answer.failure is not None or answer.conversation is None:
                episode.failure = EnvFailure(answer.failure or "interface", answer.detail)
                continue
            episode.opened = True
            prompt = starts[episode.group].prompt_tokens
            ids = self.encoder.prompt_ids(answer.conversation)
            if ids[: len(prompt)] != prompt or len(ids) - len(prompt) >= self.limits.max_episode_tokens:
                episode.failure = EnvFailure("init", "env.init's conversation does not render to the learner's "
                                             "prompt (followed only by messages it appended, within the budget)")
                continue
            episode.conversation = answer.conversation
            episode.add(ids[len(prompt):])
            prompts[episode.key] = ids
        return prompts

    def _send_steps(self, episodes: list[_Episode], ends: list[TurnEnd],
                    waiting: dict[int, tuple[TurnEnd, str]]) -> None:
        """Send the environment steps of the turns that just ended, without waiting for them."""
        calls = []
        for end in ends:
            episode = episodes[end.key]
            episode.add(end.tokens, end.logprobs)
            episode.finish_reason = end.finish_reason
            action = decode_completion(self.tokenizer, end.tokens, end.finish_reason, self.eos)
            waiting[end.key] = (end, action)
            calls.append(EnvCall(end.key, "step", action))
        if calls:
            self.envs.submit(EnvCalls(calls))

    def _resume(self, episodes: list[_Episode], answer: EnvAnswer, waiting: dict[int, tuple[TurnEnd, str]],
                generator: TurnGenerator) -> None:
        """An observation came back: the episode goes on from its cache, or ends; a failure ends its group."""
        episode = episodes[answer.episode]
        end, action = waiting.pop(answer.episode)
        episode.env_seconds += answer.seconds
        if any(e.failure is not None for e in episodes if e.group == episode.group):
            return  # a group with a failed episode goes back unscored: its other episodes stop here
        chunk = self._after(episode, end, action, answer)
        if chunk is not None:
            episode.add(chunk)
            generator.resume(end, chunk, self._room(episode))
        elif episode.failure is not None:
            generator.cancel({e.key for e in episodes if e.group == episode.group})

    def _after(self, episode: _Episode, end: TurnEnd, action: str, answer: EnvAnswer) -> Optional[list[int]]:
        """The environment ids to go on with, or None when the episode is over (ended or failed)."""
        if answer.failure is not None or answer.step is None:
            episode.failure = EnvFailure(answer.failure or "interface", answer.detail)
            return None
        episode.reward += answer.step.reward
        if answer.step.done:
            episode.end = "done"
            return None
        if len(episode.turns) >= self.limits.max_turns:
            episode.end = "max_turns"
            return None
        try:
            chunk = self.encoder.chunk(episode.conversation, end.tokens[-1], answer.step.observations)
        except TemplateError as exc:
            episode.failure = EnvFailure("template", str(exc))
            return None
        if len(episode.tokens) + len(chunk) >= self.limits.max_episode_tokens or not chunk:
            episode.end = "budget"  # no room for the observation and one sampled token
            return None
        episode.conversation = [*episode.conversation, {"role": "assistant", "content": action},
                                *answer.step.observations]
        return chunk

    def _close(self, episodes: list[_Episode]) -> None:
        calls = [EnvCall(e.key, "close") for e in episodes if e.opened and e.failure is None]
        if calls:
            for episode, answer in zip([e for e in episodes if e.opened and e.failure is None],
                                       self.envs.run_envs(EnvCalls(calls))):
                episode.env_seconds += answer.seconds

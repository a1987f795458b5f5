"""The training thread's part of evaluation: a round with no actor to take it, and reporting rounds to trackers.

Runs on the training thread, which owns the model: the prompts are claimed
under the lock, generated and scored outside it (requests keep being answered),
and the results recorded under it again. Finished rounds go to the experiment
trackers from here too, so only this thread ever calls them.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

from grpo_fleet.config import RunConfig
from grpo_fleet.envs.protocol import env_extras
from grpo_fleet.envs.runner import EnvRunner, EpisodeLimits, EpisodeRunner, EpisodeStart
from grpo_fleet.learner.actors.registry import Registry
from grpo_fleet.learner.evals.evaluation import Evaluation
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.learner.records.trackers import Trackers
from grpo_fleet.models.generation import SamplingSettings
from grpo_fleet.models.loading import Policy
from grpo_fleet.tasks import Example, Task, reward_kwargs
from grpo_fleet.tasks.env_module import EnvSetup
from grpo_fleet.tasks.prompts import chat_messages, decode_completion, encode_prompt
from grpo_fleet.tasks.reward_runner import RewardSet, Scorer, ScoringProcess

log = logging.getLogger("grpo_fleet.learner")
# How long a round waits for an actor before the learner evaluates it itself:
# actors loading the model at start-up should get the round, not the learner.
ACTOR_WAIT_SECONDS = 10.0


class LocalEvaluator:
    """Evaluates waiting eval prompts on the learner's own model; its rewards run in their own process."""

    def __init__(self, cfg: RunConfig, task: Task, policy: Policy, lock: AbstractContextManager[Any],
                 state: LearnerState, registry: Registry, evaluation: Evaluation, trackers: Trackers,
                 make_scorer: Callable[[RewardSet], Scorer] = ScoringProcess, wait_seconds: float = ACTOR_WAIT_SECONDS,
                 make_envs: Optional[Callable[[EnvSetup], EnvRunner]] = None) -> None:
        self.cfg, self.task, self.policy = cfg, task, policy  # the model and what it is evaluated on
        self.lock, self.state, self.registry, self.evaluation = lock, state, registry, evaluation
        self.trackers, self.make_scorer, self.wait_seconds = trackers, make_scorer, wait_seconds
        self._scorer: Scorer | None = None
        # task.env's episodes: in a child process (envs/process.py) unless told otherwise; started when needed.
        self.make_envs = make_envs
        self._envs: Optional[EnvRunner] = None

    def run_if_needed(self) -> bool:
        """Evaluate the round's waiting prompts if no actor is connected; True if it did."""
        self.report_finished()
        with self.lock:
            if self.registry.actors:
                return False
            indices = self.evaluation.claim_for_learner(self.wait_seconds)
            version = self.state.version
        if not indices:
            return False
        log.info("no actor connected: the learner evaluates %d held-out prompts itself", len(indices))
        started = time.perf_counter()
        rewards = self._evaluate(indices)
        with self.lock:
            self.evaluation.record_learner(rewards, version)
            self.evaluation.finish()
        self.report_finished()
        log.info("learner evaluated %d prompts in %.1fs", len(indices), time.perf_counter() - started)
        return True

    def _evaluate(self, indices: list[int]) -> dict[int, list[float] | None]:
        from grpo_fleet.models.evaluate import sample_and_score  # generation code: only the fallback needs it

        if self._scorer is None:
            self._scorer = self.make_scorer(self.task.reward_set())
        sampling = self.evaluation.sampling()
        examples = [self.task.eval[i] for i in indices]
        model = self.policy.model
        model.eval()  # no adapter dropout while generating
        try:
            if self.task.env is not None:
                results = self._episodes(examples, sampling.samples, sampling.temperature)
            else:
                results = sample_and_score(model, self.policy.tokenizer, self.task, self.cfg, examples,
                                           self._scorer, samples=sampling.samples, temperature=sampling.temperature)
        finally:
            model.train()
        return dict(zip(indices, results))

    def _episodes(self, examples: list[Example], samples: int, temperature: float) -> list[Optional[list[float]]]:
        """Each held-out prompt's episodes (a prompt's score is its episode's reward, plus the task's rewards if
        any), its environment in a child process as on an actor; None where an environment or a reward failed."""
        from grpo_fleet.envs.process import EnvProcess  # starts processes: only an episode run's fallback needs it

        env = self.task.env
        assert env is not None and self._scorer is not None
        if self._envs is None:
            self._envs = (self.make_envs or EnvProcess)(env)
        tokenizer, task = self.policy.tokenizer, self.cfg.task
        eos = sorted(int(t) for t in tokenizer.eos_token_ids)
        settings = SamplingSettings(group_size=samples, max_tokens=self.cfg.generation.max_tokens,
                                    temperature=temperature, stop_token_ids=eos)
        runner = EpisodeRunner(self.policy.model, tokenizer, settings,
                               EpisodeLimits(env.max_turns, env.max_episode_tokens), self._envs)
        groups = runner.run([episode_start(tokenizer, example, task.system_prompt, env.max_turns)
                             for example in examples])
        results: list[Optional[list[float]]] = []
        for example, outcomes in zip(examples, groups):
            if any(o.failure is not None for o in outcomes):
                results.append(None)
                continue
            totals: Optional[list[float]] = [o.reward for o in outcomes]
            if self.task.reward_names:
                texts = [decode_completion(tokenizer, o.completion.tokens, o.completion.finish_reason, set(eos))
                         for o in outcomes]
                (score,) = self._scorer.score([self.task.job(example, texts)])
                totals = None if score.rewards is None else [o.reward + r for o, r in zip(outcomes, score.rewards)]
            results.append(totals)
        return results

    def report_finished(self) -> None:
        """Send finished rounds to the trackers, at the step each finished at (trackers want steps increasing)."""
        with self.lock:
            finished, self.evaluation.finished = self.evaluation.finished, []
        for step, record in finished:
            scalars = {"reward": record.eval_reward, "pass_at_k": record.eval_pass_at_k, "started_step": record.step}
            self.trackers.log(step, {f"eval/{k}": float(v) for k, v in scalars.items() if v is not None})

    def pending(self) -> bool:
        """Whether an eval round is still running (the final one is waited for before the learner stops)."""
        with self.lock:
            return self.evaluation.current is not None

    def close(self) -> None:
        self.report_finished()
        if self._scorer is not None:
            self._scorer.close()
        close = getattr(self._envs, "close", None)
        if callable(close):
            close()


def episode_start(tokenizer: Any, example: Example, system_prompt: Optional[str], max_turns: int) -> EpisodeStart:
    """A held-out prompt as an episode starts on an actor: the learner's prompt ids, their conversation, the extras."""
    messages = chat_messages(example.prompt, system_prompt)
    columns = {key: value for key, value in reward_kwargs(example).items() if key != "answer"}
    return EpisodeStart(prompt_tokens=encode_prompt(tokenizer, example.prompt, chat_template=True,
                                                    system_prompt=system_prompt),
                        messages=messages, extras=env_extras(columns, example.answer, max_turns))

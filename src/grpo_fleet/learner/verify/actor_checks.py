"""Trust, but verify: the learner checks what actors report against what it can compute itself.

An actor is a machine the learner does not control. The learner owns every
prompt's answer and the policy's weights, so it can check both things an actor
reports besides tokens:

- **Rewards** (`RewardCheck`). Every group is re-scored at intake from the
  completion tokens (decoded with the learner's tokenizer, exactly as the actor
  must have) and the answer the learner holds. A reward that differs beyond
  float noise is `reward_mismatch`: the group is refused and the actor charged a
  violation.
- **Logprobs** (`LogprobCheck`). A group's reported logprobs are compared with
  the learner's own under the weights of the version it claims, kept for the
  versions still trainable (`WeightHistory`), before it trains. Groups at the
  version the step trains from are compared inside the step's own forward
  (learner/step/fused_check.py); older ones are recomputed here, every group of
  an actor on probation and a random share after (learner/verify/trust.py). A
  mean or single-token gap beyond the honest bound of the actor's dtype pair on
  this model (learner/step/gap_bounds.py, learner/verify/gap_calibration.py) is
  `logprob_mismatch`: wrong weights, altered logprobs, and a lied-about or stale
  version all show up as a gap. Such an actor is banned at once and its
  buffered groups are dropped, so nothing from it is trained after that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.step.batch import build_train_batch, split_batch, unpack_completions
from grpo_fleet.learner.step.forward import frozen_logprobs
from grpo_fleet.learner.step.gap_bounds import GapBound, group_gap
from grpo_fleet.learner.step.recheck import weights_of
from grpo_fleet.learner.verify.env_replay import EnvReplay
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks import Example, Task
from grpo_fleet.tasks.prompts import decode_completion
from grpo_fleet.tasks.reward_runner import Scorer
from grpo_fleet.tasks.scoring import GroupScore, RewardError

log = logging.getLogger("grpo_fleet.learner")
# Rewards are recomputed with the same code on the same text: only float formatting can differ.
REWARD_TOLERANCE = 1e-6


def reward_gap(reported: Sequence[float], recomputed: Sequence[float]) -> float:
    """The largest difference, relative to the reward's size (1 at least)."""
    return max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(reported, recomputed))


def timed_out(score: GroupScore) -> bool:
    """Whether a reward ran past its timeout on the group (the learner's hard deadline included)."""
    return score.failure is not None and score.failure.error is RewardError.TIMEOUT


class RewardCheck:
    """Re-scores submitted groups with the learner's own rewards and answers (and, in a run with a deterministic
    environment, the episodes' own rewards by replaying them: learner/verify/env_replay.py)."""

    def __init__(self, task: Task, examples: list[Example], tokenizer: Any, scorer: Scorer,
                 replay: Optional[EnvReplay] = None) -> None:
        self.task, self.examples, self.tokenizer, self.scorer = task, examples, tokenizer, scorer
        self.replay = replay
        self.eos = set(tokenizer.eos_token_ids)
        # Verdicts scored ahead of `verdicts` (outside the learner's lock), by the group object they are for.
        self._ahead: dict[int, tuple[m.GroupResult, Optional[RejectReason]]] = {}

    def score_ahead(self, groups: Sequence[tuple[m.GroupResult, int]]) -> None:
        """Score `groups` now, so that `verdicts` on these same objects answers at once (one thread at a time)."""
        scored = self._score(groups)
        self._ahead = {id(group): (group, scored[group.group_id]) for group, _ in groups}

    def forget_ahead(self) -> None:
        self._ahead = {}

    def verdicts(self, groups: Sequence[tuple[m.GroupResult, int]]) -> dict[str, Optional[RejectReason]]:
        """group_id -> None (the rewards agree), REWARD_MISMATCH, REWARD_TIMEOUT (the reward ran out of time on these
        completions), ENV_REPLAY_MISMATCH or ENV_REPLAY_TIMEOUT (door/env_replay.py), or REWARD_UNVERIFIABLE (our
        check failed otherwise)."""
        ahead = {group.group_id: self._ahead[id(group)][1] for group, _ in groups
                 if self._ahead.get(id(group), (None,))[0] is group}
        return {**self._score([(g, i) for g, i in groups if g.group_id not in ahead]), **ahead}

    def _score(self, groups: Sequence[tuple[m.GroupResult, int]]) -> dict[str, Optional[RejectReason]]:
        verdicts: dict[str, Optional[RejectReason]] = {}
        overran = False
        for (group, index), score in zip(groups, self._task_scores(groups)):
            if score.rewards is None:
                verdicts[group.group_id] = (RejectReason.REWARD_TIMEOUT if timed_out(score)
                                            else RejectReason.REWARD_UNVERIFIABLE)
                continue
            expected: list[float] = score.rewards
            if self.replay is not None:
                if overran:  # one replay of this submission ran out of time: its other groups are charged alike,
                    verdicts[group.group_id] = RejectReason.ENV_REPLAY_TIMEOUT  # so it holds the thread once
                    continue
                replayed, refusal = self._replayed(group, self.examples[index], score.rewards)
                overran = refusal is RejectReason.ENV_REPLAY_TIMEOUT
                if replayed is None:
                    verdicts[group.group_id] = refusal
                    continue
                expected = replayed
            gap = reward_gap([c.reward for c in group.completions], expected)
            verdicts[group.group_id] = RejectReason.REWARD_MISMATCH if gap > REWARD_TOLERANCE else None
        return verdicts

    def _replayed(self, group: m.GroupResult, example: Example,
                  task_rewards: list[float]) -> tuple[Optional[list[float]], Optional[RejectReason]]:
        """The group's expected rewards (the task's plus its replayed episodes'), or why there are none."""
        assert self.replay is not None
        replayed = self.replay.replay_group(example, group.completions)
        for field, reason, said in (("problem", RejectReason.ENV_REPLAY_MISMATCH, "differs from the replay"),
                                    ("overran", RejectReason.ENV_REPLAY_TIMEOUT, "held the replay too long"),
                                    ("failed", RejectReason.REWARD_UNVERIFIABLE, "unverifiable: the environment "
                                     "failed on the learner")):
            why = next((getattr(r, field) for r in replayed if getattr(r, field)), "")
            if why:
                log.warning("group %s %s: %s", group.group_id, said, shown(why, 300))
                return None, reason
        return [task + r.reward for task, r in zip(task_rewards, replayed)], None

    def stop_replays(self) -> None:
        """The learner is stopping: a replay in flight ends now (its group unverifiable), and none starts after."""
        if self.replay is not None:
            self.replay.stop()

    def _task_scores(self, groups: Sequence[tuple[m.GroupResult, int]]) -> list[GroupScore]:
        """The task's rewards of each group (0 each in an episode run that names none), or why they failed here."""
        if not self.task.reward_names:
            return [GroupScore(rewards=[0.0] * len(group.completions)) for group, _ in groups]
        scores: list[GroupScore] = []
        for group, index in groups:  # one submission's groups
            if scores and timed_out(scores[-1]):
                # The reward ran out of time on this submission: its other groups are not scored (each would
                # hold the one verifier thread as long) and are charged alike.
                scores.append(scores[-1])
                continue
            job = self.task.job(self.examples[index], [self._text(c) for c in group.completions])
            scores.extend(self.scorer.score([job]))
        return scores

    def _text(self, completion: m.Completion) -> str:
        return decode_completion(self.tokenizer, completion.tokens.to_numpy().tolist(), completion.finish_reason, self.eos)

    def close(self) -> None:
        self.stop_replays()
        self.scorer.close()


class WeightHistory:
    """The trainable weights of the versions still within reach of training, by version.

    MLX arrays are immutable and an optimizer update makes new ones, so keeping
    a version costs a reference per array: nothing under LoRA, the trainable
    weights once more per kept version under full fine-tuning.
    """

    def __init__(self, model: nn.Module, keep: int) -> None:
        self.model, self.keep = model, keep
        self.versions: dict[int, list[tuple[str, mx.array]]] = {}

    def record(self, version: int) -> None:
        flat: Any = tree_flatten(self.model.trainable_parameters())  # a list of (name, array) pairs
        self.versions[version] = list(flat)
        for old in [v for v in self.versions if v < version - self.keep]:
            del self.versions[old]


@dataclass(frozen=True)
class LogprobGap:
    group_id: str
    mean: float
    max: float
    bound: float  # the largest mean an honest group has
    token_bound: float = float("inf")  # the largest single-token gap an honest group has
    broke: Optional[str] = None  # "mean" or "token" when beyond its bound


class LogprobCheck:
    """Recomputes a group's logprobs under the version it claims (training thread only: it swaps weights)."""

    def __init__(self, model: nn.Module, history: WeightHistory, *, temperature: float, chunk_tokens: int,
                 micro_batch_tokens: int, max_gap: Optional[float] = None, observe: Optional[Any] = None,
                 observe_seconds: Optional[Any] = None) -> None:
        self.model, self.history, self.observe, self.observe_seconds = model, history, observe, observe_seconds
        self.temperature, self.chunk_tokens, self.micro_batch_tokens = temperature, chunk_tokens, micro_batch_tokens
        self.max_gap = max_gap  # security.max_logprob_gap: overrides each group's own bound when set

    def gap(self, group: AcceptedGroup) -> Optional[LogprobGap]:
        """Mean and max |reported - recomputed| over the group's tokens; None when that version is not kept."""
        return self.gaps([group])[0]

    def gaps(self, groups: Sequence[AcceptedGroup]) -> list[Optional[LogprobGap]]:
        """`gap` of each group, in order: one forward per claimed version (and group size), not one per group,
        since on a small model a forward's cost is mostly per call."""
        found: list[Optional[LogprobGap]] = [None] * len(groups)
        together: dict[tuple[int, int], list[int]] = {}
        for index, group in enumerate(groups):
            together.setdefault((group.policy_version, len(group.completions)), []).append(index)
        for (version, _), indices in together.items():
            weights = self.history.versions.get(version)
            if weights is None:
                continue
            started = time.perf_counter()
            members = [groups[i] for i in indices]
            for index, gap in zip(indices, self._recomputed(members, weights)):
                found[index] = gap
            if self.observe_seconds is not None:  # on the step's path: the fleet simulator needs it
                per_group = (time.perf_counter() - started) / len(indices)
                for _ in indices:
                    self.observe_seconds(per_group)
        return found

    def _recomputed(self, groups: list[AcceptedGroup], weights: list[tuple[str, mx.array]]) -> list[LogprobGap]:
        """The groups' gaps under `weights`, in one batch."""
        batch = build_train_batch(groups)
        micro = split_batch(batch, self.micro_batch_tokens)
        with weights_of(self.model, weights):
            values = frozen_logprobs(self.model, micro, temperature=self.temperature, chunk_tokens=self.chunk_tokens)
        rows, width = batch.mask.shape
        ours = unpack_completions(micro, values, (rows, width))
        mask, reported = np.array(batch.mask) != 0, np.array(batch.old_logprobs)
        gaps, first = [], 0
        for group in groups:
            own = slice(first, first + len(group.completions))  # rows are group-major
            first = own.stop
            mean, worst = group_gap(reported[own][mask[own]], ours[own][mask[own]])
            bound = self.bound_of(group)
            gaps.append(LogprobGap(group.group_id, mean, worst, bound.mean, bound.token, bound.judge(mean, worst)))
        return gaps

    def bound_of(self, group: AcceptedGroup) -> GapBound:
        """The group's own bound (its actor's dtype pair, calibrated), its mean overridden by security.max_logprob_gap."""
        bound = group.bound
        return bound if self.max_gap is None else GapBound(self.max_gap, bound.token)

    def failures(self, groups: Sequence[AcceptedGroup]) -> list[tuple[AcceptedGroup, LogprobGap]]:
        """The groups among `groups` whose gap is beyond their bound (the dtypes', or security.max_logprob_gap)."""
        failed = []
        for group, gap in zip(groups, self.gaps(groups)):
            if gap is not None and self.observe is not None:
                self.observe(gap.mean)
            if gap is not None and gap.broke is not None:
                failed.append((group, gap))
        return failed

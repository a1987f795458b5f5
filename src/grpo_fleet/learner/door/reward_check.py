"""Trust, but verify, the rewards: every group is re-scored at intake from the completion tokens.

The learner owns every prompt's answer, so it re-scores each group from its
completion tokens (decoded with the learner's tokenizer, exactly as the actor
must have) and the answer it holds. A reward that differs beyond float noise is
`reward_mismatch`: the group is refused and the actor charged a violation.
The logprobs are checked in learner/door/logprob_check.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.tasks import Example, Task
from grpo_fleet.tasks.prompts import decode_completion
from grpo_fleet.tasks.reward_runner import Scorer

# Rewards are recomputed with the same code on the same text: only float formatting can differ.
REWARD_TOLERANCE = 1e-6


def reward_gap(reported: Sequence[float], recomputed: Sequence[float]) -> float:
    """The largest difference, relative to the reward's size (1 at least)."""
    return max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(reported, recomputed))


class RewardCheck:
    """Re-scores submitted groups with the learner's own rewards and answers."""

    def __init__(self, task: Task, examples: list[Example], tokenizer: Any, scorer: Scorer) -> None:
        self.task, self.examples, self.tokenizer, self.scorer = task, examples, tokenizer, scorer
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
        """group_id -> None (the rewards agree), REWARD_MISMATCH, or REWARD_UNVERIFIABLE (our check failed)."""
        ahead = {group.group_id: self._ahead[id(group)][1] for group, _ in groups
                 if self._ahead.get(id(group), (None,))[0] is group}
        return {**self._score([(g, i) for g, i in groups if g.group_id not in ahead]), **ahead}

    def _score(self, groups: Sequence[tuple[m.GroupResult, int]]) -> dict[str, Optional[RejectReason]]:
        jobs = [self.task.job(self.examples[index], [self._text(c) for c in group.completions])
                for group, index in groups]
        verdicts: dict[str, Optional[RejectReason]] = {}
        for (group, _), score in zip(groups, self.scorer.score(jobs) if jobs else []):
            if score.rewards is None:
                verdicts[group.group_id] = RejectReason.REWARD_UNVERIFIABLE
                continue
            gap = reward_gap([c.reward for c in group.completions], score.rewards)
            verdicts[group.group_id] = RejectReason.REWARD_MISMATCH if gap > REWARD_TOLERANCE else None
        return verdicts

    def _text(self, completion: m.Completion) -> str:
        return decode_completion(self.tokenizer, completion.tokens.to_numpy().tolist(), completion.finish_reason, self.eos)

    def close(self) -> None:
        self.scorer.close()

"""The records most shared across the learner: a group of completions as accepted from an actor.

Plain data. Intake makes them, the hand-off buffers them, the checks judge them,
persistence saves them and the run's coordinator trains them; the step itself
sees them only through `learner/step/batch.py`'s `ScoredGroup` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grpo_fleet.learner.step.gap_bounds import HALF_PRECISION_BOUND, HALF_PRECISION_TOKEN_BOUND, GapBound


@dataclass
class CompletionRecord:
    """One completion as accepted from an actor."""

    tokens: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], under pi_behav (the actor's snapshot)
    reward: float
    finish_reason: str  # "stop", or "length": cut off at generation.max_tokens

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class AcceptedGroup:
    """A validated group of G completions of one prompt."""

    group_id: str
    prompt_index: int
    prompt_tokens: np.ndarray  # int32 [P]
    completions: list[CompletionRecord]
    policy_version: int
    actor_id: str
    actor_key: str = ""  # the peer key its violations and bans are counted under
    # Picked to be checked against the learner's own logprobs before it trains (every group of an actor on probation,
    # a random share after: learner/fleet/trust.py), against these bounds: the honest mean and worst-token gaps of the
    # actor's dtype on this model (learner/step/gap_bounds.py). Saved with the group: a checkpoint never unflags it.
    check_logprobs: bool = False
    logprob_bound: float = HALF_PRECISION_BOUND
    token_bound: float = HALF_PRECISION_TOKEN_BOUND

    @property
    def bound(self) -> GapBound:
        return GapBound(self.logprob_bound, self.token_bound)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([c.reward for c in self.completions], dtype=np.float32)

    @property
    def is_informative(self) -> bool:
        """False when every completion got the same reward, so every advantage is 0: dynamic sampling drops it."""
        rewards = self.rewards
        return bool(rewards.max() != rewards.min())

    @property
    def num_tokens(self) -> int:
        return int(sum(len(c.tokens) for c in self.completions))

"""The records most shared across the learner: a group of completions as accepted from an actor.

Plain data. Intake makes them, the hand-off buffers them, the checks judge them,
persistence saves them and the run's coordinator trains them; the step itself
sees them only through `learner/step/batch.py`'s `ScoredGroup` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from grpo_fleet.learner.step.gap_bounds import HALF_PRECISION_BOUND, HALF_PRECISION_TOKEN_BOUND, GapBound


@dataclass
class CompletionRecord:
    """One completion as accepted from an actor."""

    tokens: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], under pi_behav (the actor's snapshot)
    reward: float
    finish_reason: str  # "stop", or "length": cut off at generation.max_tokens
    # An episode's (task.env): 1 where the model sampled the token, 0 where the environment gave it; the offsets
    # where its sampled turns start; why it ended ("done", "max_turns", "budget"). None / "": all sampled.
    mask: Optional[np.ndarray] = None  # uint8 [T]
    turns: Optional[list[int]] = None
    end: str = ""

    @property
    def truncated(self) -> bool:
        """Cut off: a single completion at generation.max_tokens, an episode by task.max_episode_tokens."""
        return self.end == "budget" if self.mask is not None else self.finish_reason == "length"

    @property
    def sampled(self) -> np.ndarray:
        """bool [T]: the tokens the model sampled (every one, unless an episode's environment gave some)."""
        return np.ones(len(self.tokens), bool) if self.mask is None else self.mask != 0


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
    # a random share after: learner/verify/trust.py), against these bounds: the honest mean and worst-token gaps of the
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

"""The records of an eval round: its leases, its prompts' scores, and the helpers that name and size them.

Kept apart from the round's bookkeeping (evaluation.py), which leases, takes and writes rounds: these are the plain
data it works on, and the small pure functions over them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from grpo_fleet.config import TrainConfig
from grpo_fleet.learner.actors.leasing import lease_size
from grpo_fleet.protocol import messages as m

# An eval prompt unscored this many times is left out of its round (counted in the row).
MAX_EVAL_ATTEMPTS = 3


def eval_sampling(train: TrainConfig) -> m.EvalSampling:
    """How an eval prompt is sampled: once, greedy, or `eval_samples` times at `eval_temperature`."""
    greedy = train.eval_mode == "greedy"
    return m.EvalSampling(samples=1 if greedy else train.eval_samples,
                          temperature=0.0 if greedy else train.eval_temperature)


def eval_summary(rewards: Sequence[Sequence[float]], pass_reward: float) -> tuple[Optional[float], Optional[float]]:
    """avg@k and pass@k of a round: each prompt's k sample rewards, in any order.

    avg@k is the mean over prompts of the mean of their k samples. pass@k is the
    share of prompts where at least one of the k samples reaches `pass_reward`:
    with n = k samples, the unbiased estimator 1 - C(n-c, k) / C(n, k) is exactly
    that (1 when c > 0, else 0).
    """
    if not rewards:
        return None, None
    avg = float(np.mean([np.mean(samples) for samples in rewards]))
    passed = float(np.mean([any(r >= pass_reward for r in samples) for samples in rewards]))
    return avg, passed


def submitted_ids(msg: m.Rollouts) -> list[str]:
    """Every group id a submission names, scored or not."""
    return [g.group_id for g in msg.groups] + [u.group_id for u in msg.unscored]


def eval_group_id(serial: int) -> str:
    return f"e{serial:08d}"


def names_eval_groups(msg: m.Rollouts) -> bool:
    """Whether every group a submission names is an eval group (`eval_group_id`; training ids start with `g`)."""
    return all(group_id[:1] == "e" and group_id[1:].isdigit() for group_id in submitted_ids(msg))


def eval_lease_size(requested: int, limit: int, groups_per_second: Optional[float], group_size: int, samples: int,
                    target_seconds: float) -> int:
    """Eval prompts to lease: what the actor samples in `target_seconds` at its measured training speed.

    The speed is in training groups of `group_size` completions; an eval prompt is
    `samples` completions, so the actor does group_size / samples of them in a
    group's time. At least one; an actor not measured yet gets what it asked for.
    """
    rate = None if groups_per_second is None else groups_per_second * group_size / samples
    return lease_size(requested, limit, rate, target_seconds)


@dataclass
class EvalLease:
    lease_id: str
    actor: str
    deadline: float
    tickets: dict[str, int]  # group id -> eval prompt index
    issued_at: float = 0.0


@dataclass
class EvalRound:
    """One evaluation of the held-out prompts at one step."""

    step: int
    version: int
    started: float
    pending: deque[int]  # eval prompt indices not yet leased
    leases: dict[str, EvalLease] = field(default_factory=dict)
    # Leases that expired in this round (their prompts went back): a late result still scores what is unscored.
    late: dict[str, EvalLease] = field(default_factory=dict)
    rewards: dict[int, list[float]] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)
    dropped: int = 0
    on_learner: int = 0  # prompts the learner evaluated itself

    @property
    def complete(self) -> bool:
        return not self.pending and not self.leases

    def lease(self, lease_id: str) -> Optional[EvalLease]:
        """An open lease of this round, or one that expired in it."""
        return self.leases.get(lease_id) or self.late.get(lease_id)

    def give_back(self, lease_id: str) -> None:
        """An open lease's prompts back in the round (it expired, or its actor went away); the lease is kept in
        `late`, so its result still scores what nobody has scored meanwhile."""
        lease = self.late[lease_id] = self.leases.pop(lease_id)
        self.put_back(lease.tickets.values())

    def put_back(self, indices: Iterable[int]) -> None:
        """Prompts to lease again, less those scored meanwhile (by a late result) and those waiting already."""
        waiting = set(self.pending)
        self.pending.extend(i for i in indices if i not in self.rewards and i not in waiting)

    def score(self, index: int, rewards: list[float], version: int, *, late: bool) -> bool:
        """One prompt's samples; False (nothing kept) when it is scored already, or, from a `late` lease, when it
        no longer waits (it was left out of the round meanwhile)."""
        if index in self.rewards:
            return False
        if late and index not in self.pending and not any(index in lease.tickets.values()
                                                          for lease in self.leases.values()):
            return False
        if index in self.pending:
            self.pending.remove(index)
        self.rewards[index] = rewards
        self.versions.append(version)
        return True

    def retry(self, index: int) -> None:
        """A prompt sent back unscored: leased again, or left out of the round after MAX_EVAL_ATTEMPTS."""
        if index in self.rewards:  # a late result scored it meanwhile
            return
        self.attempts[index] = self.attempts.get(index, 0) + 1
        if self.attempts[index] >= MAX_EVAL_ATTEMPTS:
            self.dropped += 1
        else:
            self.put_back([index])



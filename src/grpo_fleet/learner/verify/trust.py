"""How much of an actor's work the logprob check recomputes: everything on probation, a random share after.

Checking every group costs a forward pass per group on the learner, as much as
the step itself, and caps the fleet at two Macs. Most of that buys nothing: an
actor that has been honest for a while is likely still honest. So trust follows
the evidence about each actor key:

- **Probation** (every group checked): a key the learner has not seen pass
  `probation_groups` checks in this life of the learner. A new key, a new Hello
  (either side restarted or reconnected), and any violation start it again. A
  learner restart forgets every record, so all actors begin on probation.
- **After probation** each group is checked with probability `share`, drawn
  from the operating system's randomness, so an actor cannot predict which of
  its groups will be looked at.

Exposure of a *sleeper* liar, one that turns dishonest after its probation: each
lying group is checked with probability p = `share`, independently, and the
first checked one bans it and drops everything of its still buffered. The number
of its groups trained before that is geometric: (1 - p) / p expected (4 at
p = 0.2), and more than k with probability (1 - p)^k (more than 20: 1.2%).
Groups sampled at the version the step trains from are checked for free, inside
the step's own forward (learner/step: the fused check), so those are always
checked whatever the share.

The record is bounded: probation is the absence of a record (a Hello or a
violation forgets the key, so garbage from fresh routing ids stores nothing), and
at most MAX_TRUSTED_KEYS keys that passed checks are remembered; beyond that the
key whose last pass is the oldest is forgotten, which puts it back on probation
(the safe direction: its groups are all checked again).
"""

from __future__ import annotations

import random
import secrets
from dataclasses import dataclass, field

# Keys whose passed checks are remembered at most (an honest fleet has a few dozen).
MAX_TRUSTED_KEYS = 4096


def expected_exposure(share: float) -> float:
    """Groups a sleeper liar trains, on average, before its first checked group (geometric in `share`)."""
    return (1.0 - share) / share if share > 0 else float("inf")


@dataclass
class Trust:
    """Per actor key: how many checks it has passed since its probation began, and the draw for the rest."""

    probation_groups: int
    share: float
    passed: dict[str, int] = field(default_factory=dict)
    draw: random.Random = field(default_factory=secrets.SystemRandom)

    def begin_probation(self, key: str) -> None:
        """A new Hello or a violation: check every group of `key` again until it has passed enough."""
        self.passed.pop(key, None)  # no record is probation: a flood of fresh keys grows nothing

    def on_probation(self, key: str) -> bool:
        return self.passed.get(key, 0) < self.probation_groups

    def wants_check(self, key: str) -> bool:
        """Whether to recompute the next group of `key` (unpredictably, after probation)."""
        return self.on_probation(key) or self.draw.random() < self.share

    def record_pass(self, key: str, groups: int = 1) -> None:
        """Count `groups` passed checks of `key`; the key whose last pass is the oldest is forgotten beyond
        MAX_TRUSTED_KEYS."""
        self.passed[key] = self.passed.pop(key, 0) + groups  # re-inserted: the dict keeps the oldest last pass first
        while len(self.passed) > MAX_TRUSTED_KEYS:
            del self.passed[next(iter(self.passed))]

    def forget(self, key: str) -> None:
        self.passed.pop(key, None)

"""Deliberately corrupted actors, for the tests that show the learner catches them (never for real runs).

`GRPO_FLEET_TEST_CORRUPT=KIND` in a real actor process's environment makes it
lie in one way, as a broken or tampered Mac would:

- `rewards`: every reported reward is 0.25 higher than its rewards gave;
- `logprobs`: every reported logprob is halved;
- `weights`: the model is perturbed after every load, so it samples from other weights;
- `version`: it never loads a snapshot (it samples from the base model it loaded from disk, version 0)
  but claims the newest version it has heard of.

The learner must catch each within one lease (learner/verification.py).
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from grpo_fleet.protocol import messages as m

ENV = "GRPO_FLEET_TEST_CORRUPT"
KINDS = ("rewards", "logprobs", "weights", "version")


class Corruption:
    """The one lie this actor tells (or none)."""

    def __init__(self, kind: Optional[str]) -> None:
        if kind not in (None, "", *KINDS):
            raise ValueError(f"{ENV}={kind!r}: one of {', '.join(KINDS)}")
        self.kind = kind or None

    @classmethod
    def from_environment(cls) -> "Corruption":
        return cls(os.environ.get(ENV))

    @property
    def frozen_weights(self) -> bool:
        """`version`: keep the base weights loaded from disk, whatever the learner publishes."""
        return self.kind == "version"

    def after_load(self, model: nn.Module) -> None:
        """`weights`: perturb what was just loaded, by half of each tensor's spread."""
        if self.kind != "weights":
            return
        perturbed = tree_map(lambda w: w + 0.5 * mx.std(w) * mx.random.normal(w.shape, dtype=w.dtype),
                             model.trainable_parameters())
        model.update(perturbed)
        mx.eval(model.parameters())

    def claimed_version(self, loaded: int, newest: int) -> int:
        return newest if self.kind == "version" else loaded

    def rollouts(self, msg: m.Rollouts) -> m.Rollouts:
        """`rewards` / `logprobs`: the submission as the lying actor sends it."""
        if self.kind not in ("rewards", "logprobs"):
            return msg
        groups = [group.model_copy(update={"completions": [self._completion(c) for c in group.completions]})
                  for group in msg.groups]
        return msg.model_copy(update={"groups": groups})

    def _completion(self, completion: m.Completion) -> m.Completion:
        if self.kind == "rewards":
            return completion.model_copy(update={"reward": completion.reward + 0.25})
        halved = (completion.logprobs.to_numpy() * 0.5).astype(np.float32)
        return completion.model_copy(update={"logprobs": m.Tensor.from_numpy(halved)})

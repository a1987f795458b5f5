"""A deliberately corrupted actor, for the tests that show the learner catches it (never for real runs).

Run as `python tests/liars/corrupt_actor.py KIND ACTOR-ARGS...`, where ACTOR-ARGS
are `grpo-fleet actor`'s. It is that actor, lying in one way as a broken or
tampered Mac would:

- `rewards`: every reported reward is 0.25 higher than its rewards gave;
- `logprobs`: every reported logprob is halved;
- `weights`: the model is perturbed after every load, so it samples from other weights;
- `version`: it never loads a snapshot (it samples from the base model it loaded from disk, version 0)
  but claims the newest version it has heard of.

The learner must catch each within one lease (learner/verify/actor_checks.py). The lies
live here, under tests/, so that the installed package has no switch that makes
a production actor lie.
"""

from __future__ import annotations

import logging
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from pydantic import BaseModel

from grpo_fleet.actor.worker import ActorWorker
from grpo_fleet.cli.main import actor_config, build_parser
from grpo_fleet.config import ActorConfig
from grpo_fleet.protocol import messages as m

KINDS = ("rewards", "logprobs", "weights", "version")


class LyingActor(ActorWorker):
    """`ActorWorker` telling one lie (`KINDS`) through its weight loads and its submissions."""

    def __init__(self, cfg: ActorConfig, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
        super().__init__(cfg)
        self.kind = kind
        honest_send = self.link.send

        def send(msg: BaseModel) -> None:
            # Every submission lies on its way out, whichever path made it: the rolling batch (actor/streaming.py)
            # or a lease run alone (an eval lease). Lying where one path builds it let the other's through honest.
            honest_send(self._lie(msg) if isinstance(msg, m.Rollouts) else msg)

        self.link.send = send  # type: ignore[method-assign]

    def _sync_weights(self) -> None:
        if self.kind == "version":
            # Keeps the base weights loaded from disk (v0 of a fresh run) and says it loaded whatever the learner
            # publishes. (Saying v0 instead, the rolling batch would start no work at a version so far behind.)
            self.weights.loaded = self.weights.newest
            return
        super()._sync_weights()
        if self.kind == "weights":
            assert self.policy is not None
            perturb(self.policy.model)

    def _lie(self, honest: m.Rollouts) -> m.Rollouts:
        if self.kind == "version":
            return honest.model_copy(update={"policy_version": self.weights.newest})
        return lie_about(honest, self.kind)


def perturb(model: nn.Module) -> None:
    """Move every trainable tensor by half its spread, at random."""
    perturbed = tree_map(lambda w: w + 0.5 * mx.std(w) * mx.random.normal(w.shape, dtype=w.dtype),
                         model.trainable_parameters())
    model.update(perturbed)
    mx.eval(model.parameters())


def lie_about(msg: m.Rollouts, kind: str) -> m.Rollouts:
    """`rewards` / `logprobs`: the submission as the lying actor sends it; other kinds leave it as it is."""
    if kind not in ("rewards", "logprobs"):
        return msg
    groups = [group.model_copy(update={"completions": [_lie(c, kind) for c in group.completions]})
              for group in msg.groups]
    return msg.model_copy(update={"groups": groups})


def _lie(completion: m.Completion, kind: str) -> m.Completion:
    if kind == "rewards":
        return completion.model_copy(update={"reward": completion.reward + 0.25})
    halved = (completion.logprobs.to_numpy() * 0.5).astype(np.float32)
    return completion.model_copy(update={"logprobs": m.Tensor.from_numpy(halved)})


def main(argv: list[str]) -> int:
    kind, *actor_args = argv
    args = build_parser().parse_args(["actor", *actor_args])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    LyingActor(actor_config(args), kind).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

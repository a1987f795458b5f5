"""What the intake accepts: decode limits, the run's rules, usable versions, and the pure checks behind them.

Plain data and NumPy, no state of their own: `Intake` (intake.py) applies them to
each Rollouts, and `suspect_groups` finds whom to blame for a non-finite step.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Optional

import numpy as np

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.actors.registry import ActorInfo
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import Limits
from grpo_fleet.protocol.reasons import RejectReason

# msgpack framing around one completion's tensors (keys, dtype, shape, reward) and one
# group (its id); generous, so an honest Rollouts never comes near the limit.
COMPLETION_FRAMING_BYTES = 256
GROUP_FRAMING_BYTES = 512
# Room for the envelope, and for the largest other request (a Hello).
MESSAGE_FRAMING_BYTES = 64 * 1024


def inbound_limits(cfg: RunConfig) -> Limits:
    """Decode limits for what actors send: no more than the largest lease's Rollouts can need.

    Bytes, groups and completions are all bounded by the lease size, so a hostile
    message costs the request loop no more than an honest one (the 14 MB, 100k
    completion Rollouts that held it for seconds is now dropped by libzmq).
    """
    server, gen, task = cfg.server, cfg.generation, cfg.task
    # A token travels as an int32/uint32 id plus a float32 logprob; an episode's also as a uint8 of its mask, and
    # each of its turns as one offset (a msgpack int, at most 5 bytes).
    per_completion = (9 * task.max_episode_tokens + 5 * task.max_turns if task.env else 8 * gen.max_tokens)
    per_group = gen.group_size * (per_completion + COMPLETION_FRAMING_BYTES) + GROUP_FRAMING_BYTES
    size = min(server.max_message_bytes, MESSAGE_FRAMING_BYTES + server.max_groups_per_lease * per_group)
    return Limits(
        max_message_bytes=size, max_bin_len=size,
        max_array_len=max(256, server.max_groups_per_lease, gen.group_size, task.max_turns if task.env else 0),
        max_rollout_groups=server.max_groups_per_lease, max_group_completions=gen.group_size,
    )


@dataclass(frozen=True)
class IntakeRules:
    """What a usable submission must satisfy in this run."""

    group_size: int
    vocab_size: int
    max_tokens: int
    reward_bound: float
    max_staleness: int
    groups_per_step: int
    reward_names: frozenset[str] = frozenset()
    # The tokens that end sampling: each single-turn completion's finish_reason is checked against them. None: not.
    stop_token_ids: Optional[frozenset[int]] = None
    # task.max_episode_tokens in a run with an environment (every completion an episode, up to that long); else None.
    episode_tokens: Optional[int] = None

    @classmethod
    def from_config(cls, cfg: RunConfig, vocab_size: int,
                    stop_token_ids: Optional[frozenset[int]] = None) -> "IntakeRules":
        gen = cfg.generation
        return cls(group_size=gen.group_size, vocab_size=vocab_size, max_tokens=gen.max_tokens,
                   reward_bound=cfg.task.reward_bound, max_staleness=cfg.grpo.max_staleness,
                   groups_per_step=cfg.grpo.groups_per_step, reward_names=frozenset(cfg.task.rewards),
                   stop_token_ids=stop_token_ids,
                   episode_tokens=cfg.task.max_episode_tokens if cfg.task.env else None)

    def invalid(self, msg: m.Rollouts) -> Optional[RejectReason]:
        """Why `msg` cannot be trained on in this run (messages.validate_rollouts), or None."""
        return m.validate_rollouts(msg, group_size=self.group_size, vocab_size=self.vocab_size,
                                   max_tokens=self.max_tokens, reward_bound=self.reward_bound,
                                   stop_token_ids=self.stop_token_ids, episode_tokens=self.episode_tokens)


def unusable_version(msg: m.Rollouts, state: LearnerState, max_staleness: int,
                     kept: Optional[Collection[int]] = None) -> Optional[RejectReason]:
    """Why rollouts cannot train this policy (None = they can); none of these is the actor's fault.

    After a resume, actors may still hold versions the previous life published
    past its last checkpoint: those numbers either do not exist yet in this
    life or name other weights, so such work is stale, never a violation.
    """
    version = msg.policy_version
    if version > state.version:
        return RejectReason.UNPUBLISHED_VERSION
    if msg.incarnation != state.incarnation and version > state.history_version:
        return RejectReason.PREVIOUS_INCARNATION
    if state.version - version > max_staleness:
        return RejectReason.STALE_VERSION
    if kept is not None and version not in kept:
        # The logprob check keeps no weights of it (full fine-tuning, after a resume): it could not be checked.
        return RejectReason.VERSION_GONE
    return None


def accepted_group(group: m.GroupResult, prompt_index: int, prompt_tokens: np.ndarray, version: int,
                   actor: ActorInfo) -> AcceptedGroup:
    """A validated wire group as the record the learner trains on, in the dtypes it trains in."""
    completions = [
        CompletionRecord(tokens=c.tokens.to_numpy().astype(np.int32), logprobs=c.logprobs.to_numpy().astype(np.float32),
                         reward=float(c.reward), finish_reason=c.finish_reason,
                         mask=None if c.mask is None else c.mask.to_numpy().astype(np.uint8),
                         turns=None if c.turns is None else list(c.turns), end=c.end)
        for c in group.completions
    ]
    return AcceptedGroup(group_id=group.group_id, prompt_index=prompt_index, prompt_tokens=prompt_tokens,
                         completions=completions, policy_version=version, actor_id=actor.actor_id,
                         actor_key=actor.principal)


def mean_completion_tokens(group: m.GroupResult) -> float:
    return sum(c.tokens.shape[0] for c in group.completions) / max(1, len(group.completions))


def suspect_groups(groups: list[AcceptedGroup], reward_bound: float) -> dict[str, RejectReason]:
    """group_id -> reason for every group holding a value out of its float32 bounds."""
    suspects: dict[str, RejectReason] = {}
    for group in groups:
        # In float32, as trained: a reward of 1e39 is inf here.
        logprobs = np.concatenate([c.logprobs.astype(np.float32) for c in group.completions])
        with np.errstate(over="ignore", invalid="ignore"):  # overflowing is what we look for
            reason = m.values_out_of_bounds(logprobs, group.rewards, reward_bound)
        if reason is not None:
            suspects[group.group_id] = reason
    return suspects

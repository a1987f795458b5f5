"""Why the learner did not accept submitted rollouts: the one list of reasons.

Each value is what travels in `Ack.reason`, labels `grpo_fleet_learner_rejections_total`
(and `_violations_total` for the ones that are the sender's fault), and what the
tests assert. The string values are the wire and the dashboards: never rename one.
"""

from __future__ import annotations

from enum import Enum


class RejectReason(str, Enum):
    """A reason rollouts (or one group of them) were not accepted."""

    # The message itself cannot be trained on (messages.validate_rollouts): a violation.
    DUPLICATE_GROUP_IN_MESSAGE = "duplicate_group_in_message"
    BAD_GROUP_SIZE = "bad_group_size"
    LENGTH_MISMATCH = "length_mismatch"
    TOO_LONG = "too_long"
    TOKEN_OUT_OF_RANGE = "token_out_of_range"
    BAD_LOGPROB = "bad_logprob"
    BAD_REWARD = "bad_reward"
    # `finish_reason` disagrees with the tokens: "stop" must end at a stop token (and hold no earlier one), "length"
    # must have exactly max_tokens and no stop token (truncated completions are masked; a false "stop" escapes that).
    FINISH_REASON_MISMATCH = "finish_reason_mismatch"
    # An episode (mask, turns, end) in a run without an environment, or a single completion in a run with one.
    EPISODE_MISMATCH = "episode_mismatch"
    # Replaying a deterministic environment (task.env's `deterministic = True`) on the learner with the episode's
    # actions gave other observation tokens or another reward than the actor reported (verify/env_replay.py).
    ENV_REPLAY_MISMATCH = "env_replay_mismatch"
    # Replaying it ran past a call's task.env_timeout_seconds or the group's security.replay_seconds once the
    # environment had the episode's actions: charged to the submitter (a violation), as a reward timeout is.
    ENV_REPLAY_TIMEOUT = "env_replay_timeout"
    # Groups the sender was never given: a violation.
    NOT_YOUR_LEASE = "not_your_lease"
    NOT_LEASED = "not_leased"
    # What the learner recomputed disagrees with what the actor reported (verify/actor_checks.py): a violation.
    REWARD_MISMATCH = "reward_mismatch"
    LOGPROB_MISMATCH = "logprob_mismatch"
    # The learner's own reward check failed (a reward raised, or its process died, here): not the actor's fault,
    # re-queued.
    REWARD_UNVERIFIABLE = "reward_unverifiable"
    # The learner's reward ran past task.reward_timeout_seconds on the actor's completions, which the actor says it
    # scored in time with the same reward: charged to the submitter (a violation), and the prompt re-queued.
    REWARD_TIMEOUT = "reward_timeout"
    # One group that cannot count (again): the network's or the learner's doing.
    DUPLICATE = "duplicate"
    STALE_LEASE = "stale_lease"
    # Work sampled from a policy this learner cannot train on: never the actor's fault.
    UNPUBLISHED_VERSION = "unpublished_version"
    PREVIOUS_INCARNATION = "previous_incarnation"
    STALE_VERSION = "stale_version"
    STALE_AT_TRAIN = "stale_at_train"  # buffered too long for grpo.max_train_staleness: dropped and re-queued
    # The version the group claims is not among the weights the logprob check keeps (after a full fine-tuning
    # resume): it could not be checked, so it is not trained.
    VERSION_GONE = "version_gone"
    RUN_DONE = "run_done"
    # Eval results no round waits for: their round finished (they came after its lease expired and others scored
    # its prompts), or the learner restarted since. Never the actor's fault.
    EVAL_ROUND_DONE = "eval_round_done"
    # The learner's own bug while judging a message (an exception where a refusal was due): never the sender's
    # fault, so never a violation; counted in grpo_fleet_learner_internal_errors_total and logged with a traceback.
    INTERNAL = "internal"

    def __str__(self) -> str:
        # Prometheus labels and f-strings take str(): they must see the wire value.
        return self.value

    @property
    def is_violation(self) -> bool:
        """True when the sender is to blame: the answer is `invalid` and it counts toward a ban."""
        return self in _VIOLATIONS

    @property
    def group_status(self) -> str:
        """What `Ack.groups` says for one group refused for this reason."""
        if self is RejectReason.DUPLICATE:
            return "duplicate"
        return "invalid" if self.is_violation else "stale"


_VIOLATIONS = frozenset({
    RejectReason.DUPLICATE_GROUP_IN_MESSAGE, RejectReason.BAD_GROUP_SIZE, RejectReason.LENGTH_MISMATCH,
    RejectReason.TOO_LONG, RejectReason.TOKEN_OUT_OF_RANGE, RejectReason.BAD_LOGPROB, RejectReason.BAD_REWARD,
    RejectReason.FINISH_REASON_MISMATCH, RejectReason.EPISODE_MISMATCH, RejectReason.ENV_REPLAY_MISMATCH,
    RejectReason.ENV_REPLAY_TIMEOUT,
    RejectReason.NOT_YOUR_LEASE, RejectReason.NOT_LEASED,
    RejectReason.REWARD_MISMATCH, RejectReason.LOGPROB_MISMATCH, RejectReason.REWARD_TIMEOUT,
})

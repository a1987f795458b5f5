"""Accepted groups dropped before they train: out of the buffer, their prompts retried, each drop in the ledger.

Two things drop buffered groups: a failed logprob check (intake.blame_tampered:
nothing of a liar trains) and grpo.max_train_staleness (training.drop_too_stale).
"""

from __future__ import annotations

from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.runlog import DropEntry, RunLog
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.protocol.reasons import RejectReason


def drop_buffered(state: LearnerState, runlog: RunLog, dropped: list[AcceptedGroup], reason: RejectReason) -> None:
    """Take accepted groups out of the buffer untrained, retry their prompts as new groups, ledger each drop.

    The dropped group's id stays finished (it was accepted once); the ledger's
    "dropped" line is what tells an audit it was never trained, and names the
    group that replaces it.
    """
    gone = {id(group) for group in dropped}
    state.buffer = [group for group in state.buffer if id(group) not in gone]
    for group in dropped:
        retry = state.scheduler.retry_prompt(group.prompt_index)
        runlog.dropped(DropEntry(group_id=group.group_id, prompt_index=group.prompt_index, actor_id=group.actor_id,
                                 actor_key=group.actor_key, reason=str(reason), step=state.step, retried_as=retry.group_id))

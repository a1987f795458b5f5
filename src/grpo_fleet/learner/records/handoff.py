"""The one hand-off from the I/O thread to the training thread: the accepted, untrained groups, and the
condition the training thread sleeps on until a batch of them is there.

The groups themselves are `LearnerState.buffer`, oldest first (a checkpoint saves them). Every change to
them goes through this object, under the run's lock: intake puts a group, a failed logprob check
(intake.blame_tampered: nothing of a liar trains) or grpo.max_train_staleness drops some, and the training
thread takes a batch. A drop takes groups out untrained, retries their prompts as new groups and writes each
drop to the ledger.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.runlog import DropEntry, RunLog
from grpo_fleet.learner.records.state import LearnerState
from grpo_fleet.protocol.reasons import RejectReason


class BatchHandOff:
    """Accepted groups from intake to the training thread; the caller holds `lock` for every method but `wait`."""

    def __init__(self, state: LearnerState, runlog: RunLog, lock: Any, groups_per_step: int) -> None:
        self.state, self.runlog, self.groups_per_step = state, runlog, groups_per_step
        self.batch_ready = threading.Condition(lock)  # the training thread sleeps on it
        self.wakeups = 0  # how many times a full batch woke the training thread

    def put(self, group: AcceptedGroup) -> None:
        """Buffer an accepted, informative group; a full batch wakes the training thread."""
        self.state.buffer.append(group)
        if len(self.state.buffer) >= self.groups_per_step:
            self.wakeups += 1
            self.batch_ready.notify()

    def take(self, count: int) -> list[AcceptedGroup]:
        """The `count` oldest groups, out of the buffer."""
        groups, self.state.buffer = self.state.buffer[:count], self.state.buffer[count:]
        return groups

    def drop(self, dropped: list[AcceptedGroup], reason: RejectReason) -> None:
        """Take accepted groups out of the buffer untrained, retry their prompts as new groups, ledger each drop.

        The dropped group's id stays finished (it was accepted once); the ledger's
        "dropped" line is what tells an audit it was never trained, and names the
        group that replaces it.
        """
        state = self.state
        gone = {id(group) for group in dropped}
        state.buffer = [group for group in state.buffer if id(group) not in gone]
        for group in dropped:
            retry = state.scheduler.retry_prompt(group.prompt_index)
            self.runlog.dropped(DropEntry(group_id=group.group_id, prompt_index=group.prompt_index,
                                          actor_id=group.actor_id, actor_key=group.actor_key, reason=str(reason),
                                          step=state.step, retried_as=retry.group_id))

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """On the training thread, without the lock: block until `ready()` (or `timeout` passes)."""
        with self.batch_ready:
            return self.batch_ready.wait_for(ready, timeout)

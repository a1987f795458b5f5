"""The learner's run state, the one explicit record its rooms share under the run's lock, and what changes it.

`LearnerState` is what a checkpoint saves. `AckCache` keeps the answer given for
each lease, so that a resent Rollouts gets the same answer again. `BatchHandOff`
is the one hand-off from the I/O thread to the training thread: the groups are
`LearnerState.buffer`, oldest first, and every change to them goes through it,
under the run's lock. Intake puts a group; a failed logprob check
(intake.blame_tampered: nothing of a liar trains) or grpo.max_train_staleness
drops some; the training thread takes a batch. A drop takes groups out untrained,
retries their prompts as new groups and writes each drop to the ledger.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from grpo_fleet.learner.records.actor_ids import ActorIds
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.records.lease_book import PromptScheduler
from grpo_fleet.learner.records.runlog import DropEntry, RunLog
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.reasons import RejectReason

# Stored answers kept for replays (at-least-once actors resend after a reconnect).
ACK_CACHE_SIZE = 4096


class AckCache:
    """The answer given for each lease, replayed to a resent Rollouts; bounded, oldest out first."""

    def __init__(self, size: int = ACK_CACHE_SIZE, answers: Optional[dict[str, m.Ack]] = None) -> None:
        self.size = size
        self._answers: dict[str, m.Ack] = dict(answers or {})

    def get(self, lease_id: str) -> Optional[m.Ack]:
        return self._answers.get(lease_id)

    def put(self, lease_id: str, ack: m.Ack) -> None:
        # Bounded, so no peer can grow it without limit.
        self._answers[lease_id] = ack
        while len(self._answers) > self.size:
            self._answers.pop(next(iter(self._answers)))

    def answers(self) -> dict[str, m.Ack]:
        """A copy, oldest first (what a checkpoint saves)."""
        return dict(self._answers)


@dataclass
class LearnerState:
    """Everything the learner is the source of truth for, besides weights and optimizer state.

    A checkpoint saves all of it but `incarnation` and `history_version`
    (persistence.capture / save); a resume restores it (persistence.load / restore).
    Only the training thread moves `step` and `version`, always under the lock.
    """

    run_id: str
    # This life of the learner process (m.Incarnation): new on every start and resume.
    incarnation: str
    steps_target: int
    scheduler: PromptScheduler  # prompt order, open leases, finished groups
    acks: AckCache = field(default_factory=lambda: AckCache())  # answers replayed to resent Rollouts
    actor_ids: ActorIds = field(default_factory=ActorIds)  # which key owns which actor id, for the whole run
    step: int = 0
    version: int = 0
    # Versions up to here were published, with these same weights, by earlier lives too.
    history_version: int = 0
    # Whether the live weights are version `version`'s: not after a step that did not publish (train.sync_every > 1).
    weights_published: bool = True
    buffer: list[AcceptedGroup] = field(default_factory=list)  # informative, accepted, untrained; oldest first
    accepted_since_step: int = 0
    zero_variance_since_step: int = 0
    started: float = field(default_factory=time.monotonic)  # moved back by the wall time of earlier lives

    @property
    def done(self) -> bool:
        return self.step >= self.steps_target

    def wall_seconds(self) -> float:
        """Training wall time of the whole run, earlier lives included."""
        return time.monotonic() - self.started


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

    def put_back(self, groups: list[AcceptedGroup]) -> None:
        """Groups taken for a batch that did not train (a check found a lie among them): first in line again."""
        self.state.buffer[:0] = groups

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
            retry = state.scheduler.queue.retry_prompt(group.prompt_index)
            self.runlog.dropped(DropEntry(group_id=group.group_id, prompt_index=group.prompt_index,
                                          actor_id=group.actor_id, actor_key=group.actor_key, reason=str(reason),
                                          step=state.step, retried_as=retry.group_id))

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """On the training thread, without the lock: block until `ready()` (or `timeout` passes)."""
        with self.batch_ready:
            return self.batch_ready.wait_for(ready, timeout)

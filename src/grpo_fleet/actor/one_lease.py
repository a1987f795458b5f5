"""The actor's plain path, for episodes: one lease generated whole and submitted, the next one asked for meanwhile.

Kept apart from the worker's loop (worker.py), which chooses between this and the rolling batch (streaming.py).
"""

from __future__ import annotations

from typing import Callable, Optional

from grpo_fleet.actor.link import LearnerLink
from grpo_fleet.actor.pipeline import InFlight
from grpo_fleet.protocol import messages as m


class OneLeaseAtATime:
    """Takes the prefetched lease (or asks for one), generates it through `rollout`, and submits the result once
    the previous submission is acknowledged."""

    def __init__(self, link: LearnerLink, inflight: InFlight, max_groups: int, *, stopping: Callable[[], bool],
                 sleep: Callable[[float], None], rollout: Callable[[m.Lease], m.Rollouts]) -> None:
        self.link, self.inflight, self.max_groups = link, inflight, max_groups
        self.stopping, self.sleep, self.rollout = stopping, sleep, rollout

    def turn(self) -> None:
        """Generate one lease whole and submit it, the next one asked for meanwhile."""
        lease = self._take_lease()
        if lease is None:
            return
        if not self.stopping():
            self._request_lease()  # answered while this lease generates
        rollouts = self.rollout(lease)
        self.link.await_answers(lambda: self.inflight.submitted is None)  # the previous Ack is normally long in
        self.inflight.submitted = rollouts
        self.link.send(rollouts)

    def _request_lease(self) -> None:
        self.link.send(m.LeaseRequest(max_groups=self.max_groups))
        self.inflight.lease_requested = True

    def _take_lease(self) -> Optional[m.Lease]:
        """The lease to generate now: the prefetched one, or one asked for now; None if there is none."""
        if self.inflight.next_lease is None and not self.inflight.lease_requested:
            if self.stopping():
                self.link.await_answers(lambda: self.inflight.submitted is None)
                return None
            self._request_lease()
        self.link.await_answers(lambda: self.inflight.next_lease is not None)
        lease = self.inflight.take_lease()
        assert lease is not None  # await_answers returned: one is booked
        if not lease.prompts:
            self.sleep(lease.retry_after)
            return None
        return lease

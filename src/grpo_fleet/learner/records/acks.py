"""The answer given for each lease, kept so that a resent Rollouts gets the same answer again."""

from __future__ import annotations

from typing import Optional

from grpo_fleet.protocol import messages as m

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

"""The door's transport (learner/door/transport.py) with frames held in memory: the I/O edge of the learner's
loop, so that its admission, decoding and dispatch (learner/door/dispatch.py) run in a unit test, on the bytes a
peer would send, without a socket."""

from __future__ import annotations

from collections import deque
from typing import Optional

from pydantic import BaseModel

from grpo_fleet.protocol import decode, encode
from grpo_fleet.protocol.sockets import RoutedFrames


class MemoryTransport:
    """What peers sent waits in `inbox`; every reply the door sends is kept, encoded, in `sent`, every notice in
    `published`."""

    def __init__(self) -> None:
        self.inbox: deque[RoutedFrames] = deque()
        self.sent: list[tuple[bytes, bytes, Optional[bytes]]] = []  # (identity, payload, raw frame)
        self.published: list[bytes] = []

    def deliver(self, identity: bytes, *frames: bytes, principal: Optional[str] = None) -> None:
        """A message from peer `identity`, as these payload frames (one, for a well-formed message)."""
        self.inbox.append(RoutedFrames(identity, principal, "10.0.0.9", [memoryview(f) for f in frames]))

    def receive(self, timeout_ms: int) -> Optional[RoutedFrames]:
        return self.inbox.popleft() if self.inbox else None

    def reply(self, identity: bytes, message: BaseModel, raw: Optional[memoryview] = None, *,
              track: bool = False) -> None:
        self.sent.append((identity, encode(message), None if raw is None else bytes(raw)))
        return None  # copied: nothing for the door to track

    def publish(self, message: BaseModel) -> None:
        self.published.append(encode(message))

    def replies_to(self, identity: bytes) -> list[BaseModel]:
        """The messages sent to `identity`, decoded as the peer would."""
        return [decode(payload) for to, payload, _ in self.sent if to == identity]

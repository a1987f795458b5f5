"""The door's I/O edge: what the learner's loop needs of its sockets, and nothing more.

`RouterTransport` (server.py) is the ZeroMQ one: a ROUTER for requests and a PUB for notices. Admission,
decoding and dispatch (dispatch.py) see only this protocol, so they are tested on frames held in memory.
"""

from __future__ import annotations

from typing import Optional, Protocol

from pydantic import BaseModel

from grpo_fleet.learner.door.weights_in_flight import Tracker
from grpo_fleet.protocol.sockets import RoutedFrames


class Transport(Protocol):
    """Receives peers' frames undecoded, sends each a reply, and publishes notices to every peer."""

    def receive(self, timeout_ms: int) -> Optional[RoutedFrames]:
        """One waiting message, with who sent it, after waiting at most `timeout_ms`; None if none came."""
        ...

    def reply(self, identity: bytes, message: BaseModel, raw: Optional[memoryview] = None, *,
              track: bool = False) -> Optional[Tracker]:
        """Send `message` (and `raw`, a weight chunk's bytes, zero-copy) to `identity`; with `track`, what says
        when the transport has let go of `raw` (None when it was copied)."""
        ...

    def publish(self, message: BaseModel) -> None:
        """A notice to every subscribed peer."""
        ...

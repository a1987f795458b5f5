"""The learner's notices as the actor reads them: PolicyUpdated and Heartbeat to follow, Shutdown to stop.

Kept apart from the request channel (link.py, which opens both sockets): this side only reads, and never sends a
request itself, since it is read while another request waits for its reply and a nested request would swallow it.
"""

from __future__ import annotations

from typing import Any, Callable, Union

from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import Limits, ProtocolError
from grpo_fleet.protocol.sockets import recv_message

Notice = Union[m.PolicyUpdated, m.Heartbeat]


class StopActor(Exception):
    """The learner said Shutdown, or we were asked to stop; `notice`: said on PUB only, not yet to us directly."""

    def __init__(self, reason: str, *, notice: bool = False) -> None:
        super().__init__(reason)
        self.notice = notice


class Notices:
    """The SUB socket the link opened, drained into `on_notice` between answers."""

    def __init__(self, limits: Limits, on_notice: Callable[[Notice], None]) -> None:
        self.limits, self._on_notice = limits, on_notice
        self.sock: Any = None  # a zmq SUB socket from protocol.sockets; None while closed

    def attach(self, sock: Any) -> None:
        """Read `sock` from now on (a session begun on a late Welcome kept the last one's socket: it is closed)."""
        self.close()
        self.sock = sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = None

    def poll(self) -> None:
        """Drain the PUB channel into `on_notice`; Shutdown stops us."""
        while self.sock is not None:
            try:
                notice = recv_message(self.sock, timeout_s=0, limits=self.limits)
            except ProtocolError:
                continue
            if notice is None:
                break
            if isinstance(notice, m.Shutdown):
                raise StopActor(f"learner shut down ({notice.reason})", notice=True)
            if isinstance(notice, (m.PolicyUpdated, m.Heartbeat)):
                self._on_notice(notice)

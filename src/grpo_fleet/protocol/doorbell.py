"""The ranks' doorbell: rank 0 rings it while it broadcasts a command over MLX's ring.

MLX's ring (0.32) waits by polling a non-blocking socket in a loop, so a rank
inside a collective spins a core until the data comes. The other ranks spend
much of a run waiting for rank 0's next command: while it gathers a batch from
the actors, verifies it, evaluates or writes a checkpoint. With the bell they
wait in ZeroMQ's poll, which sleeps, and step into the ring only when rank 0
is sending.

As soon as the ring is proven, rank 0 binds a PUB socket on its ring address
at a free port and sends the others its address (learner/ranks/distributed.py,
`share_doorbell`); each subscribes. A thread of rank 0 owns the socket and
publishes two kinds of frame:
- a ring, the 8-byte number of the broadcast being sent (the run config, then
  each command: `RankGroup.announced`), repeated every `REPEAT_SECONDS` until
  the broadcast is over, so a ring that is lost (a rank that subscribed late)
  costs that long, and one for an earlier broadcast is told apart and ignored;
- a heartbeat, an empty frame every `heartbeat` seconds otherwise.

A rank that hears nothing for three heartbeats (rank 0 stopped, gone, or the
bell unreachable) steps into the ring anyway, as it did before there was a
bell, where MLX's own error or the watchdog decides. A stranger who subscribes
learns when rank 0 sends; nobody but rank 0 can ring, since each rank connects
to rank 0's socket alone.
"""

from __future__ import annotations

import logging
import re
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import zmq

from grpo_fleet.protocol.sockets import bound_endpoint, make_context

log = logging.getLogger("grpo_fleet.learner.ranks")
REPEAT_SECONDS = 0.2
MISSED_HEARTBEATS = 3
_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[0-9.]+):[0-9]{1,5}")
_QUEUED = 64  # frames a busy rank may have waiting (heartbeats during a long step); a newer ring follows anyway
_RING_BYTES = 8
_MAX_FRAME = 256


def check_bell_endpoint(endpoint: object) -> str:
    """`endpoint` if it is a `tcp://IP:PORT` address (IPv4, or IPv6 in brackets); ValueError otherwise."""
    if not isinstance(endpoint, str) or _TCP_ENDPOINT.fullmatch(endpoint) is None:
        raise ValueError(f"rank 0's doorbell {endpoint!r} is not a tcp://IP:PORT address")
    return endpoint


class Doorbell:
    """Rank 0's side: a PUB socket on `host` at a port the system picks, and the thread that owns it."""

    def __init__(self, host: str, heartbeat: float) -> None:
        self._context = make_context()
        sock = self._context.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _QUEUED)
        sock.setsockopt(zmq.IPV6, 1)  # a ring on IPv6 addresses
        try:
            sock.bind_to_random_port(f"tcp://[{host}]" if ":" in host else f"tcp://{host}")
        except zmq.ZMQError:
            sock.close(linger=0)
            self._context.term()
            raise
        self.endpoint = bound_endpoint(sock)
        self._heartbeat = heartbeat
        self._changed = threading.Condition()
        self._sending: Optional[int] = None  # the command being broadcast
        self._closed = False
        self._thread = threading.Thread(target=self._publish, args=(sock,), name="doorbell", daemon=True)
        self._thread.start()

    @contextmanager
    def ringing(self, command: int) -> Iterator[None]:
        """Ring for broadcast number `command` until the block (the broadcast) is over."""
        with self._changed:
            self._sending = command
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._sending = None

    def close(self) -> None:
        if self._closed:
            return
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()
        self._context.term()

    def _publish(self, sock: zmq.Socket) -> None:
        try:
            with self._changed:
                while not self._closed:
                    sending = self._sending
                    frame = b"" if sending is None else sending.to_bytes(_RING_BYTES, "big")
                    sock.send(frame, zmq.NOBLOCK)  # PUB drops it for a subscriber whose queue is full
                    self._changed.wait(self._heartbeat if sending is None else REPEAT_SECONDS)
        finally:
            sock.close(linger=0)


class BellListener:
    """Another rank's side: subscribed to rank 0's bell."""

    def __init__(self, endpoint: str, heartbeat: float) -> None:
        self._context = make_context()
        self._sock = self._context.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, _QUEUED)
        # Rings are 8 bytes; the limit also bounds ZeroMQ's handshake, which needs a few dozen.
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.connect(check_bell_endpoint(endpoint))
        self._silence_ms = max(1, int(MISSED_HEARTBEATS * heartbeat * 1000))
        self.rang = 0  # waits that ended on rank 0's ring
        self.missed = 0  # waits that heard nothing for three heartbeats and stepped into the ring unannounced

    def wait(self, command: int) -> bool:
        """Sleep until rank 0 rings for broadcast number `command` (or a later one): True; or until it has been
        silent for three heartbeats: False."""
        while self._sock.poll(self._silence_ms, zmq.POLLIN):
            frame = self._sock.recv(zmq.NOBLOCK)
            if len(frame) == _RING_BYTES and int.from_bytes(frame, "big") >= command:
                self.rang += 1
                return True
        self.missed += 1
        return False

    def close(self) -> None:
        self._sock.close(linger=0)
        self._context.term()


def open_bell(host: Optional[str], heartbeat: float) -> Optional[Doorbell]:
    """Rank 0's doorbell on its ring address `host`; None without one (a backend other than the ring), or where it
    cannot bind there: the ranks then wait in the ring, as they did before the bell."""
    if not host:
        return None
    try:
        return Doorbell(host, heartbeat)
    except zmq.ZMQError as exc:
        log.warning("rank 0: no doorbell on %s (%s); the other ranks will wait in MLX's ring, spinning a core", host, exc)
        return None

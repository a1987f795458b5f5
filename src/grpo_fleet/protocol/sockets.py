"""ZeroMQ socket setup and framed send/receive of protocol messages.

With auth.py (CURVE) this is where protocol/ touches zmq; outside protocol/
only the learner and actor event loops do (tests/unit/test_layering.py).
Every socket has linger=0 so a shutdown never hangs on undelivered messages,
and MAXMSGSIZE where peers are untrusted so libzmq drops an oversized frame
before it is ever buffered in Python.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import zmq
from pydantic import BaseModel
from zmq.utils.monitor import recv_monitor_message

if TYPE_CHECKING:
    from grpo_fleet.protocol.auth import Keypair

from grpo_fleet.protocol.codec import DEFAULT_LIMITS, Limits, ProtocolError, decode, encode
from grpo_fleet.protocol.messages import WeightsChunk

# Below this size copying is cheaper than zmq's zero-copy bookkeeping.
_ZERO_COPY_THRESHOLD = 64 * 1024
# An actor's longest wait between attempts to reach a learner that is not up (yet, or again).
RECONNECT_MAX_MS = 1000


def make_context() -> zmq.Context:
    """A fresh context (not the global singleton, so tests and processes stay isolated)."""
    return zmq.Context()


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint actually bound, e.g. the real port after binding to ':0'."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class AddressInUse(OSError):
    """A bind address another process holds (another learner, or another program)."""


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    """Bind, or close the socket and raise AddressInUse naming `endpoint` (one line, not a ZMQError traceback)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EADDRINUSE:
            raise
        sock.close()
        raise AddressInUse(f"{endpoint} is already in use (another learner, or another program, listens there)") from None


def check_bindable(endpoints: Sequence[str]) -> None:
    """Raise AddressInUse for the first TCP endpoint another process listens on: before a model load of minutes.

    The probe is a plain socket, bound and never listening, so a connection attempt meanwhile is refused and
    retried. A ZeroMQ probe accepted it instead: an actor already dialling reached the probe, whose handshake
    failed on the socket type, and libzmq then dropped that actor's queued Hello for good (it waited out its
    request timeout, 30 s, before trying again). An endpoint this cannot read (an interface name) is left
    to the real bind, which raises AddressInUse too.
    """
    for endpoint in endpoints:
        address = _tcp_bind_address(endpoint)
        if address is None:
            continue
        try:
            infos = socket.getaddrinfo(*address, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (socket.gaierror, UnicodeError):
            continue
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq binds: TIME_WAIT is no owner
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise AddressInUse(f"{endpoint} is already in use (another learner, or another program, "
                                       "listens there)") from None
                # Any other error (an address not on this machine) is the real bind's to report.


def _tcp_bind_address(endpoint: str) -> Optional[tuple[str, int]]:
    """(host, port) of a tcp:// bind endpoint with a fixed port; None for a random port or another transport."""
    if not endpoint.startswith("tcp://"):
        return None  # an ipc probe would take the path over
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdigit() or int(port) == 0 or int(port) > 65535:
        return None  # '*' or 0: any free port will do
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return ("0.0.0.0" if host in ("*", "") else host), int(port)


def router_socket(
    ctx: zmq.Context, bind: str, *, max_message_bytes: int, curve: Optional["Keypair"] = None
) -> zmq.Socket:
    """The learner's ROUTER (a CURVE server when `curve` is given). Bind to 'host:0' for a random port."""
    sock = ctx.socket(zmq.ROUTER)
    if curve is not None:
        from grpo_fleet.protocol.auth import make_server

        make_server(sock, curve)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    # Replies to vanished actors are dropped silently instead of raising in the loop.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    # A restarted actor reuses its identity; it must take over the old connection.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    _bind(sock, bind)
    return sock


def dealer_socket(
    ctx: zmq.Context,
    connect: str,
    *,
    identity: Optional[bytes],
    max_message_bytes: int,
    curve: Optional[tuple["Keypair", bytes]] = None,
) -> zmq.Socket:
    """An actor's DEALER; reconnects quickly at first, backing off to 1 s.

    An actor started before its learner (or waiting out a learner's restart) must join within a second of
    the learner binding: with a 5 s ceiling a short run could end before an actor knocked again.

    `curve` is (the actor's keypair, the learner's public key).
    """
    sock = ctx.socket(zmq.DEALER)
    _maybe_client(sock, curve)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
    if identity is not None:
        # libzmq reserves identities starting with a zero byte for generated ones.
        if not 1 <= len(identity) <= 255 or identity[:1] == b"\x00":
            sock.close()
            raise ValueError("identity must be 1..255 bytes and not start with a zero byte")
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(connect)
    return sock


def _maybe_client(sock: zmq.Socket, curve: Optional[tuple["Keypair", bytes]]) -> None:
    if curve is not None:
        from grpo_fleet.protocol.auth import make_client

        make_client(sock, curve[0], curve[1])


def pub_socket(ctx: zmq.Context, bind: str, *, curve: Optional["Keypair"] = None) -> zmq.Socket:
    """The learner's PUB for notices (PolicyUpdated, Shutdown); CURVE-protected like the ROUTER."""
    sock = ctx.socket(zmq.PUB)
    if curve is not None:
        from grpo_fleet.protocol.auth import make_server

        make_server(sock, curve)
    sock.setsockopt(zmq.LINGER, 0)
    _bind(sock, bind)
    return sock


def sub_socket(
    ctx: zmq.Context,
    connect: str,
    *,
    max_message_bytes: Optional[int] = None,
    curve: Optional[tuple["Keypair", bytes]] = None,
) -> zmq.Socket:
    """An actor's SUB, subscribed to everything."""
    sock = ctx.socket(zmq.SUB)
    _maybe_client(sock, curve)
    sock.setsockopt(zmq.LINGER, 0)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(connect)
    return sock


def send_message(
    sock: zmq.Socket, msg: BaseModel, *, identity: Optional[bytes] = None, raw: Optional[memoryview] = None,
    track: bool = False,
) -> Optional[zmq.MessageTracker]:
    """Send one message: [identity, payload] on a ROUTER, [payload] otherwise.

    `raw` (weight chunks only) follows as one more frame, sent zero-copy: it keeps the buffer it views alive until
    libzmq lets go of it. With `track`, the tracker that says when (None when `raw` was small enough to copy).
    """
    payload = encode(msg)
    frames: list = [payload]
    if sock.type == zmq.ROUTER:
        if identity is None:
            raise ValueError("a ROUTER needs the peer identity to send to")
        frames.insert(0, identity)
    elif identity is not None:
        raise ValueError("identity is only meaningful on a ROUTER socket")
    if raw is None:
        sock.send_multipart(frames, copy=len(payload) < _ZERO_COPY_THRESHOLD)
        return None
    sock.send_multipart(frames, flags=zmq.SNDMORE, copy=len(payload) < _ZERO_COPY_THRESHOLD)
    copied = len(raw) < _ZERO_COPY_THRESHOLD
    tracker = sock.send(raw, 0, copy=copied, track=track and not copied)
    return tracker if track and not copied else None


def recv_message(sock: zmq.Socket, *, timeout_s: float, limits: Limits = DEFAULT_LIMITS) -> Optional[BaseModel]:
    """Receive one message on a DEALER/SUB; None on timeout, ProtocolError on bad input."""
    received = recv_with_raw(sock, timeout_s=timeout_s, limits=limits)
    if received is None:
        return None
    msg, raw = received
    if raw is not None:
        raise ProtocolError("malformed", "unexpected raw frame")
    return msg


def recv_with_raw(
    sock: zmq.Socket, *, timeout_s: float, limits: Limits = DEFAULT_LIMITS
) -> Optional[tuple[BaseModel, Optional[memoryview]]]:
    """Receive a message and, for a WeightsChunk only, its raw bytes frame."""
    if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
        return None
    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    if len(frames) not in (1, 2):
        raise ProtocolError("malformed", f"expected 1 or 2 frames, got {len(frames)}")
    msg = decode(frames[0].buffer, limits)
    if len(frames) == 1:
        return msg, None
    if not isinstance(msg, WeightsChunk) or len(frames[1].buffer) != msg.length:
        raise ProtocolError("malformed", "a raw frame may only follow a WeightsChunk of that length")
    return msg, frames[1].buffer


@dataclass(frozen=True)
class Routed:
    """One message received on the ROUTER, with who sent it."""

    identity: bytes  # routing id, used to reply
    principal: Optional[str]  # the CURVE public key (ZAP User-Id) when CURVE is on
    peer_address: str
    message: Union[BaseModel, ProtocolError]


@dataclass(frozen=True)
class RoutedFrames:
    """One message received on the ROUTER, not decoded yet: who sent it is known before what it says."""

    identity: bytes
    principal: Optional[str]
    peer_address: str
    frames: Sequence[memoryview]  # the payload frames' bytes, after the routing id (zero-copy views)


def recv_routed_frames(sock: zmq.Socket) -> RoutedFrames:
    """Receive one message on the ROUTER without decoding it, with the sender's principal and address.

    Blocks: call it after a poll says the socket is readable. The principal and
    address come from libzmq's metadata on the last frame; the learner judges the
    sender on them before it spends a decode on what a banned peer sent.
    """
    frames = sock.recv_multipart(copy=False)
    principal, address = _metadata(frames[-1])
    return RoutedFrames(frames[0].bytes, principal, address, [frame.buffer for frame in frames[1:]])


def decode_routed(received: RoutedFrames, limits: Limits = DEFAULT_LIMITS) -> Routed:
    """Decode what `recv_routed_frames` took. Decode failures are returned, not raised, so the caller can reply
    to that identity and count the reason."""
    identity, principal, address = received.identity, received.principal, received.peer_address
    if len(received.frames) != 1:
        error = ProtocolError("bad_frames", f"expected [identity, payload], got {len(received.frames) + 1} frames")
        return Routed(identity, principal, address, error)
    try:
        return Routed(identity, principal, address, decode(received.frames[0], limits))
    except ProtocolError as exc:
        return Routed(identity, principal, address, exc)


def _metadata(frame: zmq.Frame) -> tuple[Optional[str], str]:
    try:
        user_id = frame.get("User-Id")
    except (zmq.ZMQError, KeyError):
        user_id = None
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, KeyError):
        address = "?"
    # Without CURVE, ZAP is not involved and there is no authenticated user.
    return (str(user_id) if user_id else None), str(address)


# ---------------------------------------------------------------- raw frames, for benchmarks and hostile peers


def send_frames(sock: zmq.Socket, frames: Sequence[Union[bytes, memoryview]]) -> None:
    """Send frames exactly as given, not encoded: a pre-built payload, a raw baseline, a hostile message."""
    size = sum(len(frame) for frame in frames)
    sock.send_multipart(list(frames), copy=size < _ZERO_COPY_THRESHOLD)


def recv_frames(sock: zmq.Socket, *, timeout_s: float) -> Optional[list[memoryview]]:
    """The raw frames of one message, not decoded; None on timeout."""
    if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
        return None
    return [frame.buffer for frame in sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)]


def wait_readable(socks: Sequence[zmq.Socket], timeout_s: float) -> list[zmq.Socket]:
    """Those of `socks` with a message waiting, after at most `timeout_s`."""
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    ready = dict(poller.poll(max(0, int(timeout_s * 1000))))
    return [sock for sock in socks if sock in ready]


class DisconnectWatch:
    """Tells when libzmq drops a socket's connection, e.g. after a frame over the peer's MAXMSGSIZE."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def disconnected(self) -> bool:
        """True when a disconnect was reported since the last call (never blocks)."""
        seen = False
        while self.monitor.poll(0, zmq.POLLIN):
            seen |= recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
        return seen

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)

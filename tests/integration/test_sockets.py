"""Framed ZeroMQ sockets over real TCP on 127.0.0.1: ROUTER/DEALER exchange, bad frames, PUB/SUB."""

from __future__ import annotations

import hashlib
import socket
import threading
from typing import Callable, Iterator

import numpy as np
import pytest
import zmq
from pydantic import BaseModel

from grpo_fleet.protocol import (
    Ack,
    Completion,
    ErrorReply,
    GroupResult,
    Heartbeat,
    LeaseRequest,
    PolicyUpdated,
    ProtocolError,
    Rollouts,
    Shutdown,
    Tensor,
    encode,
)
from grpo_fleet.protocol.endpoints import free_port
from grpo_fleet.protocol.sockets import (
    AddressInUse,
    bound_endpoint,
    check_bindable,
    dealer_socket,
    decode_routed,
    make_context,
    pub_socket,
    recv_message,
    recv_routed_frames,
    router_socket,
    send_message,
    sub_socket,
)
from wire_samples import bulky

DIGEST = hashlib.sha256(b"weights").hexdigest()


def valid_rollouts() -> Rollouts:
    """A message with raw array frames inside, to check they cross the socket intact."""
    completions = [
        Completion(tokens=Tensor.from_numpy(np.array(tokens, dtype=np.int32)),
                   logprobs=Tensor.from_numpy(np.full(len(tokens), -0.5, dtype=np.float32)), reward=reward,
                   finish_reason="stop")
        for tokens, reward in (([1, 2, 3], 1.0), ([4], 0.0))
    ]
    return Rollouts(lease_id="L1", policy_version=3, groups=[GroupResult(group_id="g0", completions=completions)])
TIMEOUT_S = 3.0


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = make_context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def sockets() -> Iterator[list[zmq.Socket]]:
    """Collects sockets a test creates and closes them with linger=0, even on failure."""
    opened: list[zmq.Socket] = []
    yield opened
    for sock in opened:
        sock.close(linger=0)


@pytest.fixture
def router(ctx: zmq.Context, sockets: list[zmq.Socket]) -> zmq.Socket:
    sock = router_socket(ctx, "tcp://127.0.0.1:0", max_message_bytes=1 << 20)
    sockets.append(sock)
    return sock


@pytest.fixture
def connect_dealer(ctx: zmq.Context, sockets: list[zmq.Socket], router: zmq.Socket) -> Callable[[bytes], zmq.Socket]:
    def make(identity: bytes) -> zmq.Socket:
        sock = dealer_socket(ctx, bound_endpoint(router), identity=identity, max_message_bytes=1 << 20)
        sockets.append(sock)
        return sock

    return make


def routed(router: zmq.Socket) -> tuple[bytes, BaseModel | ProtocolError]:
    assert router.poll(int(TIMEOUT_S * 1000), zmq.POLLIN), "router received nothing"
    got = decode_routed(recv_routed_frames(router))
    return got.identity, got.message


def test_router_binds_random_port(router: zmq.Socket) -> None:
    endpoint = bound_endpoint(router)
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")


def test_dealer_router_exchange(router: zmq.Socket, connect_dealer: Callable[[bytes], zmq.Socket]) -> None:
    a, b = connect_dealer(b"actor-a"), connect_dealer(b"actor-b")
    send_message(a, LeaseRequest(max_groups=2))
    send_message(b, valid_rollouts())
    got = dict(routed(router) for _ in range(2))
    assert got == {b"actor-a": LeaseRequest(max_groups=2), b"actor-b": valid_rollouts()}

    send_message(router, Ack(lease_id="L1", status="accepted"), identity=b"actor-b")
    big = bulky(200_000)  # above the zero-copy threshold
    send_message(router, big, identity=b"actor-a")
    assert recv_message(b, timeout_s=TIMEOUT_S) == Ack(lease_id="L1", status="accepted")
    assert recv_message(a, timeout_s=TIMEOUT_S) == big
    assert recv_message(a, timeout_s=0.05) is None


def test_router_answers_garbage_with_error_reply(
    router: zmq.Socket, connect_dealer: Callable[[bytes], zmq.Socket]
) -> None:
    dealer = connect_dealer(b"bad-actor")
    dealer.send(b"\xc1not msgpack")
    identity, result = routed(router)
    assert identity == b"bad-actor"
    assert isinstance(result, ProtocolError) and result.reason == "malformed"
    send_message(router, ErrorReply(reason=result.reason, detail=str(result)), identity=identity)
    reply = recv_message(dealer, timeout_s=TIMEOUT_S)
    assert isinstance(reply, ErrorReply) and reply.reason == "malformed"


def test_three_frames_to_router_is_bad_frames(
    router: zmq.Socket, connect_dealer: Callable[[bytes], zmq.Socket]
) -> None:
    dealer = connect_dealer(b"framer")
    dealer.send_multipart([encode(Heartbeat()), b"x", b"y"])
    identity, result = routed(router)
    assert identity == b"framer"
    assert isinstance(result, ProtocolError) and result.reason == "bad_frames"


def test_multi_frame_reply_to_dealer_is_malformed(
    router: zmq.Socket, connect_dealer: Callable[[bytes], zmq.Socket]
) -> None:
    dealer = connect_dealer(b"d")
    send_message(dealer, Heartbeat())
    routed(router)
    router.send_multipart([b"d", encode(Heartbeat()), b"extra"])
    with pytest.raises(ProtocolError) as info:
        recv_message(dealer, timeout_s=TIMEOUT_S)
    assert info.value.reason == "malformed"


def test_router_handover_to_reconnected_identity(
    router: zmq.Socket, connect_dealer: Callable[[bytes], zmq.Socket]
) -> None:
    old = connect_dealer(b"same")
    send_message(old, Heartbeat(actor_id="old"))
    assert routed(router)[1] == Heartbeat(actor_id="old")
    new = connect_dealer(b"same")
    send_message(new, Heartbeat(actor_id="new"))
    assert routed(router)[1] == Heartbeat(actor_id="new")
    send_message(router, Shutdown(reason="x"), identity=b"same")
    assert recv_message(new, timeout_s=TIMEOUT_S) == Shutdown(reason="x")
    assert recv_message(old, timeout_s=0.05) is None


def test_router_drops_oversized_frames(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    small = router_socket(ctx, "tcp://127.0.0.1:0", max_message_bytes=2048)
    sockets.append(small)
    dealer = dealer_socket(ctx, bound_endpoint(small), identity=b"big", max_message_bytes=1 << 20)
    sockets.append(dealer)
    # Positive control: the same dealer's message under the limit arrives, so the silence below is the drop.
    send_message(dealer, LeaseRequest(max_groups=2))
    assert routed(small) == (b"big", LeaseRequest(max_groups=2))
    send_message(dealer, bulky(10_000))
    assert not small.poll(300, zmq.POLLIN)
    # The router stays up: libzmq closed only the offending connection, and a new peer is heard.
    fresh = dealer_socket(ctx, bound_endpoint(small), identity=b"fresh", max_message_bytes=1 << 20)
    sockets.append(fresh)
    send_message(fresh, LeaseRequest(max_groups=1))
    assert routed(small) == (b"fresh", LeaseRequest(max_groups=1))


def test_send_message_checks_identity_use(
    router: zmq.Socket, connect_dealer: Callable[[bytes], zmq.Socket]
) -> None:
    with pytest.raises(ValueError):
        send_message(router, Heartbeat())
    with pytest.raises(ValueError):
        send_message(connect_dealer(b"x"), Heartbeat(), identity=b"x")
    with pytest.raises(ValueError):
        connect_dealer(b"\x00reserved")


def test_pub_sub_notice(ctx: zmq.Context, sockets: list[zmq.Socket]) -> None:
    pub = pub_socket(ctx, "tcp://127.0.0.1:0")
    sockets.append(pub)
    sub = sub_socket(ctx, bound_endpoint(pub))
    sockets.append(sub)
    notice = PolicyUpdated(version=5, digest=DIGEST)
    # PUB drops messages until the subscription has propagated (slow joiner): resend until seen.
    for _ in range(60):
        send_message(pub, notice)
        got = recv_message(sub, timeout_s=0.05)
        if got is not None:
            break
    assert got == notice




def test_the_learners_port_check_accepts_no_connection_an_actor_could_be_making() -> None:
    # An actor dialling while the learner checked its ports once reached a ZeroMQ probe: the handshake failed
    # on the socket type and libzmq dropped the actor's queued Hello for good. The check must never listen.
    port = free_port()
    accepted, stop = [], threading.Event()

    def dial() -> None:
        while not stop.is_set():
            with socket.socket() as client:
                if client.connect_ex(("127.0.0.1", port)) == 0:
                    accepted.append(port)

    dialler = threading.Thread(target=dial, daemon=True)
    dialler.start()
    try:
        for _ in range(300):
            check_bindable([f"tcp://127.0.0.1:{port}"])
    finally:
        stop.set()
        dialler.join()
    assert not accepted, f"{len(accepted)} connections reached the port check"


def test_the_port_check_names_a_port_another_program_listens_on() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(AddressInUse, match=f"tcp://127.0.0.1:{port} is already in use"):
            check_bindable([f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{port}"])
        with pytest.raises(AddressInUse):
            check_bindable([f"tcp://*:{port}"])  # the wildcard overlaps every address
    check_bindable([f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:0", "tcp://127.0.0.1:*"])  # free again; random ports

"""The ring door: where a data-parallel learner's ranks prove they belong to the run before anything is shared.

Rank 0 serves a CURVE ROUTER with the learner's keypair, and its ZAP handler
admits only the keys in `KEYS/authorized/ranks/` (`grpo-fleet keys add-rank`).
Each other rank knocks with its own key, pinning the learner's public key, so
both sides are authenticated: a follower that gets an answer knows rank 0 holds
`learner.key_secret`, and rank 0 knows the follower holds an allowed key. The
answer is the run's ring secret, which the ranks then use over MLX's ring
(learner/ranks/ring_trust.py). A message is one small JSON frame either way.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import zmq

from grpo_fleet.protocol.auth import Keypair, KeyRing, load_keypair, make_client, make_server, start_authenticator
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.protocol.sockets import _bind, make_context

log = logging.getLogger("grpo_fleet.auth")
MAX_KNOCK_BYTES = 4096
RANKS_DIR = "authorized/ranks"


class DoorClosed(RuntimeError):
    """Not every rank was admitted before the deadline (or rank 0 could not be authenticated)."""


def open_door(keys_dir: str, endpoint: str, size: int, secret: bytes, timeout_s: float) -> Counter[str]:
    """Rank 0: admit one knock from each of ranks 1..size-1 and answer it the ring secret; close the door.

    Returns the refusals it counted by reason (a key not allowed, a malformed or
    repeated knock); raises DoorClosed naming the ranks that never came.
    """
    keys = Path(keys_dir)
    keypair = load_keypair(keys / "learner.key_secret")
    refusals: Counter[str] = Counter()
    ctx = make_context()
    auth = start_authenticator(ctx, KeyRing(keys / RANKS_DIR), lambda address, reason: _denied(refusals, address, reason))
    sock = ctx.socket(zmq.ROUTER)
    make_server(sock, keypair)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_KNOCK_BYTES)
    try:
        try:
            _bind(sock, endpoint)
        except zmq.ZMQError as exc:  # e.g. the hostfile's rank 0 address is not this machine's
            raise DoorClosed(f"cannot open the ring door on {endpoint}: {exc}") from None
        log.info("ring door open on %s: waiting up to %g s for ranks 1..%d to knock, each with a key in %s "
                 "(their distributed.key_file and distributed.learner_key_file)", endpoint, timeout_s, size - 1,
                 keys / RANKS_DIR)
        missing = set(range(1, size))
        deadline = time.monotonic() + timeout_s
        while missing and time.monotonic() < deadline:
            if sock.poll(int(min(1.0, deadline - time.monotonic()) * 1000) + 1, zmq.POLLIN):
                _answer(sock, size, secret, missing, refusals)
        if missing:
            raise DoorClosed(f"rank(s) {', '.join(map(str, sorted(missing)))} did not authenticate at the ring door "
                             f"{endpoint} within {timeout_s:g} s (a rank without an allowed key in {keys / RANKS_DIR}, "
                             "or a process that is not a rank of this run)")
        return refusals
    finally:
        sock.close(linger=0)
        auth.stop()
        ctx.term()


def _denied(refusals: Counter[str], address: str, reason: str) -> None:
    refusals["key not allowed"] += 1
    log.warning("ring door: refused a CURVE handshake from %s: %s", shown(address), shown(reason))


def _answer(sock: zmq.Socket, size: int, secret: bytes, missing: set[int], refusals: Counter[str]) -> None:
    identity, *frames = sock.recv_multipart()
    rank = _knocked_rank(frames, size)
    if rank is None or rank not in missing:
        reason = "malformed knock" if rank is None else "rank already admitted"
        refusals[reason] += 1
        log.warning("ring door: refused a knock (%s)", reason)
        sock.send_multipart([identity, b"", json.dumps({"refused": reason}).encode()])
        return
    missing.discard(rank)
    sock.send_multipart([identity, b"", json.dumps({"secret": secret.hex()}).encode()])
    log.info("ring door: rank %d authenticated", rank)


def _knocked_rank(frames: list[bytes], size: int) -> Optional[int]:
    if len(frames) != 2 or frames[0] != b"":
        return None
    try:
        rank = json.loads(frames[1]).get("rank")
    except (ValueError, AttributeError):
        return None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and 1 <= rank < size else None


def knock(endpoint: str, key_file: str, learner_key_file: str, rank: int, timeout_s: float) -> bytes:
    """A follower: the ring secret from rank 0's door, or DoorClosed when no authenticated rank 0 answers."""
    keypair = load_keypair(key_file)
    if keypair.secret is None:
        raise ValueError(f"distributed.key_file {key_file} holds no secret key; pass the NAME.key_secret file")
    server_public = load_keypair(learner_key_file).public
    ctx = make_context()
    sock = ctx.socket(zmq.REQ)
    make_client(sock, Keypair(keypair.public, keypair.secret), server_public)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_KNOCK_BYTES)
    try:
        sock.connect(endpoint)
        sock.send(json.dumps({"rank": rank}).encode())
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise DoorClosed(f"no rank 0 holding the secret half of {learner_key_file} answered at {endpoint} within "
                             f"{timeout_s:g} s (rank 0 is not this run's learner, it runs without security.keys_dir, or it "
                             "does not allow this rank's key)")
        answer = json.loads(sock.recv())
    finally:
        sock.close(linger=0)
        ctx.term()
    if not isinstance(answer, dict) or not isinstance(answer.get("secret"), str):
        reason = answer.get("refused", answer) if isinstance(answer, dict) else answer
        raise DoorClosed(f"rank 0's ring door refused rank {rank}: {shown(str(reason))}")
    return bytes.fromhex(answer["secret"])

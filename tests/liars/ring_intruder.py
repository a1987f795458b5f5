"""A process that is not a rank of the run but takes a rank's place in MLX's ring (MLX_HOSTFILE, MLX_RANK).

It holds no run secret. As a follower it knocks at rank 0's ring door with a key
of its own (not allowed), then plays the ring proof with junk. As rank 0
(`--impostor-door`) it serves a CURVE door of its own, under a keypair that is
not the learner's, answering any knock with a made-up secret, and then sends
junk over the ring. Usage: ring_intruder.py [--impostor-door ENDPOINT] [--knock ENDPOINT] SECONDS
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

import mlx.core as mx
import zmq
import zmq.auth


def _own_keys() -> tuple[bytes, bytes]:
    folder = tempfile.mkdtemp()
    _, secret_file = zmq.auth.create_certificates(folder, "intruder")
    return zmq.auth.load_certificate(secret_file)  # type: ignore[return-value]


def _knock(endpoint: str, server_public: bytes) -> None:
    """Knock at the real door with a key the learner never allowed (the ZAP handshake is refused)."""
    public, secret = _own_keys()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(json.dumps({"rank": int(os.environ["MLX_RANK"])}).encode())
    print("intruder: knocked; answer:", sock.poll(3000), flush=True)
    sock.close()
    ctx.term()


def _impostor_door(endpoint: str) -> None:
    public, secret = _own_keys()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True
    sock.bind(endpoint)
    while True:
        identity, _, _ = sock.recv_multipart()
        sock.send_multipart([identity, b"", json.dumps({"secret": "00" * 32}).encode()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impostor-door")
    parser.add_argument("--knock")
    parser.add_argument("--learner-key")
    parser.add_argument("seconds", type=float)
    args = parser.parse_args()
    if args.impostor_door:
        threading.Thread(target=_impostor_door, args=(args.impostor_door,), daemon=True).start()
    group = mx.distributed.init(strict=True, backend="ring")
    print(f"intruder: in the ring as rank {group.rank()} of {group.size()}", flush=True)
    if args.knock:
        _knock(args.knock, zmq.auth.load_certificate(args.learner_key)[0])
    size, rank = group.size(), group.rank()
    for _ in range(2):  # the ring proof's two all-gathers ([size, 8] int32), junk in its own slot
        junk = [[(rank * 8 + i + 1) if row == rank else 0 for i in range(8)] for row in range(size)]
        mx.eval(mx.distributed.all_sum(mx.array(junk, dtype=mx.int32), group=group, stream=mx.cpu))
    print("intruder: sent junk proofs", flush=True)
    time.sleep(args.seconds)


if __name__ == "__main__":
    main()

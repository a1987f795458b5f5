"""10,000 malformed or mutated messages against a live learner process.

The learner must stay up, keep its state (step, version, ledger), and answer each
message with a reply whose error is counted in a metric. Then throwaway identities
say Hello until `server.max_actors` refuses them. The learner's RSS is printed
before and after, so memory growth under fuzzing is visible (`pytest -s`).
"""

from __future__ import annotations

import random
import struct
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.codec import decode, encode
from helpers import scrape

FUZZ_EXAMPLES = 10_000
# Out of every bound the door declares: int64/uint64 ends, int32 and port edges, float32 overflow.
HOSTILE_NUMBERS = [-1, -(2**63), 2**63 - 1, 2**64 - 1, 2**31, 2**40 + 1, 65536,
                   float("nan"), float("inf"), -float("inf"), 1e39, -3e38]
CONTROL = ["\r\n[ERROR] forged", "\x1b[2J\x1b[31m", "\x00", "\t", "\u202e", " ", "\\"]
MAX_ACTORS = 8
THROWAWAY_IDENTITIES = 40


def _tensor(values, dtype) -> m.Tensor:
    return m.Tensor.from_numpy(np.asarray(values, dtype=dtype))


def _valid_corpus() -> list[bytes]:
    completion = m.Completion(tokens=_tensor([3, 4, 5], np.int32), logprobs=_tensor([-1.0, -2.0, -0.5], np.float32),
                              reward=0.5, finish_reason="stop")
    rollouts = m.Rollouts(lease_id="x" * 32, policy_version=0,
                          groups=[m.GroupResult(group_id="g00000001", completions=[completion] * 4)])
    return [encode(msg) for msg in (
        m.Hello(actor_id="fuzzer", host="h", backend="cpu", versions={"mlx": "0"}),
        m.LeaseRequest(max_groups=1),
        m.GetWeights(version=0),
        m.Heartbeat(actor_id="fuzzer"),
        rollouts,
    )] + [encode(msg) for msg in _replies(completion)]


def _replies(completion: m.Completion) -> list:
    """One of every other message type, so out-of-range numbers reach each of them."""
    digest = "0" * 64
    actor = m.ActorStatus(actor_id="a", host="h", backend="cpu", policy_version=1, tokens_per_second=1.0,
                          last_seen_seconds=0.5, groups_per_second=2.0)
    prompt = m.PromptItem(group_id="g1", prompt_index=3, prompt_tokens=completion.tokens, fields={})
    return [
        m.Welcome(run_id="r", actor_id="a", model=m.ModelRef(path="tiny", digest=digest, lora={"rank": 8, "scale": 2.0}),
                  generation=m.GenerationParams(group_size=4, max_tokens=4, temperature=1.0, top_p=1.0),
                  reward=m.RewardSpec(names=["r"], weights=[1.0]), policy_version=0, heartbeat_seconds=2.0, vocab_size=9),
        m.WeightsChunk(version=0, digest=digest, total_bytes=10, offset=0, length=10),
        m.Lease(lease_id="L", deadline_seconds=1.0, policy_version=0, prompts=[prompt], retry_after=0.5),
        m.Status(run_id="r", step=1, steps_target=2, policy_version=1, tokens_per_second=3.0, groups_accepted=4, actors=[actor]),
        m.PolicyUpdated(version=1, digest=digest),
        m.Ack(lease_id="L1", status="accepted"), m.ErrorReply(reason="x"), m.Shutdown(), m.StatusRequest(),
    ]


CORPUS = _valid_corpus()
# Text as hostile peers write it: ASCII, the control and direction characters, and any code point outside the surrogates.
TEXT_POOL = [chr(c) for c in range(32, 127)] + CONTROL + ["\u00e9", "\u6771", "\U0001f642", "\ufeff", "\uffff"]


class Draws(random.Random):
    """Seeded random values of the shapes a hostile message is made of (`choice` and `randint` are Random's own).

    Not hypothesis: its engine costs about 2 ms a message here (20 CPU-s for 10,000), and what it adds, shrinking
    a failing example, this test does not need: a failure names the frames that caused it.
    """

    def binary(self, max_size: int, min_size: int = 0) -> bytes:
        return self.randbytes(self.randint(min_size, max_size))

    def text(self, max_size: int, min_size: int = 0) -> str:
        length = self.randint(min_size, max_size)
        return "".join(self.choice(TEXT_POOL) if self.random() < 0.9 else self._code_point() for _ in range(length))

    def _code_point(self) -> str:
        point = self.randrange(0x10FFFF - 0x800)
        return chr(point if point < 0xD800 else point + 0x800)  # past the surrogates, which UTF-8 cannot carry

    def number(self) -> object:
        """Any int64/uint64, or any float64 bit pattern (nan, infinities, subnormals and -0.0 among them)."""
        if self.random() < 0.5:
            return self.choice(HOSTILE_NUMBERS) if self.random() < 0.3 else self.randint(-(2**63), 2**64 - 1)
        return struct.unpack("<d", self.randbytes(8))[0]

    def json_like(self, depth: int = 0) -> object:
        """What msgpack can carry: scalars (numbers twice as often), text and bytes, nested in lists and maps up
        to three deep."""
        kind = self.randrange(8 if depth < 3 else 6)
        if kind < 6:
            scalars = (lambda: None, lambda: self.random() < 0.5, self.number, self.number,
                       lambda: self.text(20), lambda: self.binary(20))
            return scalars[kind]()
        children = [self.json_like(depth + 1) for _ in range(self.randint(0, 4))]
        return children if kind == 6 else {self.text(8): child for child in children}


def mutated(draw: Draws) -> list[bytes]:
    """Frames for one hostile message: random, mutated, re-typed, or wrongly framed."""
    kind = draw.choice(["random", "flip", "truncate", "splice", "envelope", "frames", "semantic",
                        "numbers", "ids", "counts"])
    base = bytearray(draw.choice(CORPUS))
    if kind == "random":
        return [draw.binary(600)]
    if kind == "flip":
        for _ in range(draw.randint(1, 8)):
            base[draw.randint(0, len(base) - 1)] = draw.randint(0, 255)
        return [bytes(base)]
    if kind == "truncate":
        return [bytes(base[: draw.randint(0, len(base) - 1)])]
    if kind == "splice":
        return [bytes(base) + draw.binary(64, min_size=1)]
    if kind == "envelope":
        body = draw.json_like()
        version = draw.choice([m.PROTOCOL_VERSION, 0, 1, "2", None])
        name = draw.choice([*m.MESSAGE_TYPES, "Pickle", "", "__class__"])
        return [msgpack.packb({"v": version, "type": name, "body": body}, use_bin_type=True)]
    if kind == "frames":
        return [bytes(base)] * draw.randint(2, 4)
    if kind in HOSTILE_KINDS:
        return [HOSTILE_KINDS[kind](draw)]
    return [_semantic_violation(draw)]


def _semantic_violation(draw: Draws) -> bytes:
    """A well-formed Rollouts whose contents disagree with the run or the lease."""
    token = draw.choice([-1, 10**6, 5])
    logprob = draw.choice([0.5, float("nan"), float("inf"), -1.0])
    size = draw.choice([1, 3, 4, 9])
    length = draw.randint(1, 40)
    completion = m.Completion.model_construct(
        tokens=_tensor([token] * length, np.int32), logprobs=_tensor([logprob] * length, np.float32),
        reward=0.0, finish_reason="length",
    )
    group = m.GroupResult.model_construct(group_id=draw.text(12, min_size=1), completions=[completion] * size)
    msg = m.Rollouts.model_construct(lease_id=draw.text(12), policy_version=draw.randint(0, 5), groups=[group])
    return encode(msg)


def _number_paths(node: object, path: tuple = ()) -> list[tuple]:
    """Where the ints and floats (not bools) are in an unpacked body."""
    if type(node) is dict:
        return [p for key, child in node.items() for p in _number_paths(child, path + (key,))]
    if type(node) is list:
        return [p for i, child in enumerate(node) for p in _number_paths(child, path + (i,))]
    return [path] if type(node) in (int, float) else []


def _set(node: object, path: tuple, value: object) -> None:
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _repack(envelope: dict) -> bytes:
    return msgpack.packb(envelope, use_bin_type=True)


def _hostile_number(draw: Draws) -> bytes:
    """A valid message of any type with one of its numbers out of range."""
    envelope = msgpack.unpackb(draw.choice(WITH_NUMBERS))
    _set(envelope["body"], draw.choice(_number_paths(envelope["body"])), draw.choice(HOSTILE_NUMBERS))
    return _repack(envelope)


def _hostile_id(draw: Draws) -> bytes:
    """A Hello, Heartbeat or Rollouts with a control character (or other unsafe text) in an id."""
    target = draw.choice([(0, ("actor_id",)), (0, ("host",)), (0, ("backend",)), (3, ("actor_id",)),
                          (4, ("lease_id",)), (4, ("groups", 0, "group_id"))])
    envelope = msgpack.unpackb(CORPUS[target[0]])
    _set(envelope["body"], target[1], "fuzz" + draw.choice(CONTROL) + "id")
    return _repack(envelope)


def _hostile_counts(draw: Draws) -> bytes:
    """A Rollouts with more groups, or more completions in a group, than a lease holds."""
    # Small enough to pass the byte limit (a larger message is dropped unanswered by libzmq).
    groups, per_group = draw.choice([(5, 4), (17, 4), (257, 1), (1, 5), (1, 9), (1, 300), (4, 5)])
    envelope = msgpack.unpackb(CORPUS[4])
    completion = envelope["body"]["groups"][0]["completions"][0]
    envelope["body"]["groups"] = [{"group_id": f"g{i:08d}", "completions": [completion] * per_group} for i in range(groups)]
    return _repack(envelope)


HOSTILE_KINDS = {"numbers": _hostile_number, "ids": _hostile_id, "counts": _hostile_counts}
WITH_NUMBERS = [data for data in CORPUS if _number_paths(msgpack.unpackb(data)["body"])]


def _rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (Linux /proc; nan elsewhere)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024


def _throwaway_hellos(peer_socket, endpoint: str, count: int) -> dict[str, int]:
    """Hello from `count` fresh identities that never come back; replies by kind."""
    replies: dict[str, int] = {}
    for i in range(count):
        sock = peer_socket(endpoint, f"throwaway-{i}".encode())
        try:
            sock.send(encode(m.Hello(actor_id=f"throwaway-{i}", host="h", backend="cpu", versions={})))
            assert sock.poll(10_000), "no answer to Hello"
            reply = decode(sock.recv())
            kind = type(reply).__name__ + (f":{reply.reason}" if isinstance(reply, m.ErrorReply) else "")
            replies[kind] = replies.get(kind, 0) + 1
        finally:
            sock.close()
    return replies


def _fuzz(sock: zmq.Socket) -> dict[str, int]:
    """Send FUZZ_EXAMPLES hostile messages, one at a time, the same ones every run; replies by kind."""
    replies: dict[str, int] = {}
    draw = Draws(0)
    for _ in range(FUZZ_EXAMPLES):
        frames = mutated(draw)
        sock.send_multipart(frames)
        assert sock.poll(10_000), f"no answer to {frames[0][:40]!r}"
        # Read the whole reply: a WeightsChunk carries its blob in a second frame, which
        # must not be mistaken for the answer to the next message.
        reply = decode(sock.recv_multipart()[0])
        kind = type(reply).__name__ + (f":{reply.status}" if isinstance(reply, m.Ack) else "")
        replies[kind] = replies.get(kind, 0) + 1
        if isinstance(reply, m.Ack) and reply.status != "invalid":
            # stale or duplicate groups are rejections too, counted one per group
            refused = sum(status != "accepted" for status in reply.groups.values())
            replies["refused_groups"] = replies.get("refused_groups", 0) + refused
    return replies


@pytest.mark.slow
def test_learner_survives_ten_thousand_hostile_messages(run_config, free_port, spawn, peer_socket):
    config, cfg = run_config(
        task={"num_train": 50},
        # The learner's own default, not run_config's 2: this test has always run with it.
        grpo={"groups_per_step": 8},
        # Every hostile message is a violation; the fuzzer must never be shut out.
        server={"max_violations": 1000000, "max_actors": MAX_ACTORS},
        metrics={"port": free_port()},
    )
    learner = spawn("learner", "--config", str(config), name="learner")
    sock = peer_socket(cfg.server.bind, b"fuzzer")
    _wait_until_serving(sock, learner)
    before, rss = scrape(cfg.metrics.port).totals(), [_rss_mb(learner.pid)]
    replies = _fuzz(sock)
    after = scrape(cfg.metrics.port).totals()
    rss.append(_rss_mb(learner.pid))
    hellos = _throwaway_hellos(peer_socket, cfg.server.bind, THROWAWAY_IDENTITIES)
    rss.append(_rss_mb(learner.pid))
    final = scrape(cfg.metrics.port).totals()
    print(f"learner RSS: {rss[0]:.1f} MiB before, {rss[1]:.1f} MiB after {sum(replies.values())} hostile messages, "
          f"{rss[2]:.1f} MiB after {THROWAWAY_IDENTITIES} throwaway Hellos; replies {replies}; Hellos {hellos}")
    assert learner.poll() is None, "the learner died"
    _assert_accounted(before, after, replies, Path(cfg.run_dir))
    # The fuzzer is registered, so at most MAX_ACTORS - 1 throwaway identities get in.
    assert hellos.get("Welcome", 0) <= MAX_ACTORS - 1
    assert hellos.get("ErrorReply:too_many_actors", 0) == THROWAWAY_IDENTITIES - hellos.get("Welcome", 0)
    too_many = final["grpo_fleet_learner_protocol_errors_total"] - after["grpo_fleet_learner_protocol_errors_total"]
    assert too_many == hellos["ErrorReply:too_many_actors"]


def _assert_accounted(before: dict, after: dict, replies: dict, run_dir: Path) -> None:
    """Every refusal counted in a metric, and nothing trained, published or put in the ledger."""
    sent = sum(count for kind, count in replies.items() if kind != "refused_groups")
    assert sent >= FUZZ_EXAMPLES
    errors = replies.get("ErrorReply", 0)
    invalid = replies.get("Ack:invalid", 0)
    counted_errors = after["grpo_fleet_learner_protocol_errors_total"] - before.get("grpo_fleet_learner_protocol_errors_total", 0)
    counted_rejections = after["grpo_fleet_learner_rejections_total"] - before.get("grpo_fleet_learner_rejections_total", 0)
    assert counted_errors == errors, replies
    assert counted_rejections == invalid + replies.get("refused_groups", 0), replies
    assert errors + invalid > 0.9 * sent, replies
    assert after["grpo_fleet_learner_steps_total"] == 0
    assert after["grpo_fleet_learner_policy_version"] == 0
    assert after.get("grpo_fleet_learner_groups_accepted_total", 0) == 0
    assert (run_dir / "ledger.jsonl").read_text() == ""


def _wait_until_serving(sock: zmq.Socket, learner, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert learner.poll() is None, learner.log_path.read_text()[-2000:]
        sock.send(encode(m.Heartbeat()))
        if sock.poll(500):
            # Earlier probes may still be answered: drain them so replies line up.
            while sock.poll(1000):
                sock.recv()
            return
    raise AssertionError("learner never answered")

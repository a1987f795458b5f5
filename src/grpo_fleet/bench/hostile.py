"""Part of the ingest benchmark: how long one hostile message can hold the learner's loop.

The learner answers requests one at a time, so the time it takes to refuse the
largest message a peer can send is a stall every honest actor waits out. A real
learner process with the ingest benchmark's config (256 groups per lease, G=8,
128 tokens) is sent, by a registered peer:

* the issue's message: a Rollouts with 100k one-token completions (about 14 MB);
* the largest Rollouts a lease allows, every token out of vocabulary, which the
  learner must validate in full to refuse.

The figure is the time to the learner's answer. A message over the inbound byte
limit gets no answer (libzmq drops it and closes that connection); for it the
figure is the round trip of a Heartbeat another actor sends once it is dropped.
Messages are built as raw msgpack, so this file runs against older learners too.

A second learner re-scores rewards (security.verify_rewards) with a reward that
takes 2 seconds a group: the figure is the round trip of a Heartbeat sent while
it re-scores one honest submission.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import msgpack
import numpy as np

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.learner_process import GROUP_SIZE, MAX_TOKENS, start_learner, stop_learner, wait_serving

ISSUE_COMPLETIONS = 100_000
LEASE_GROUPS = 256  # the ingest learner's max_groups_per_lease
OUT_OF_VOCAB = 10**6
ANSWER_TIMEOUT_S = 60.0
SLOW_REWARD_SECONDS = 2.0  # per group, spread over its completions
SLOW_REWARD = f"""
import time

def slow(completion, prompt, **columns):
    time.sleep({SLOW_REWARD_SECONDS} / {GROUP_SIZE})
    return 0.0
"""


def rollouts_payload(groups: int, per_group: int, tokens: int, token_id: int) -> bytes:
    """One Rollouts envelope with `groups` x `per_group` identical completions of `tokens` tokens."""
    from grpo_fleet.protocol.messages import PROTOCOL_VERSION

    completion = {
        "tokens": {"dtype": "int32", "shape": [tokens], "data": np.full(tokens, token_id, "<i4").tobytes()},
        "logprobs": {"dtype": "float32", "shape": [tokens], "data": np.full(tokens, -1.0, "<f4").tobytes()},
        "reward": 0.0, "finish_reason": "length",
    }
    body = {"lease_id": "0" * 32, "policy_version": 0,
            "groups": [{"group_id": f"g{i:08d}", "completions": [completion] * per_group} for i in range(groups)]}
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": "Rollouts", "body": body}, use_bin_type=True)


def hostile_messages() -> dict[str, bytes]:
    per_group = -(-ISSUE_COMPLETIONS // LEASE_GROUPS)
    return {
        "100k one-token completions": rollouts_payload(LEASE_GROUPS, per_group, 1, 0),
        "largest lease, tokens out of vocabulary": rollouts_payload(LEASE_GROUPS, GROUP_SIZE, MAX_TOKENS, OUT_OF_VOCAB),
    }


def _registered(ctx: Any, endpoint: str, name: str) -> Any:
    from grpo_fleet.bench.simulated_actor import connect
    from grpo_fleet.protocol import messages as m

    client = connect({"identity": name, "endpoint": endpoint, "curve": None}, ctx)
    client.request(m.Hello(actor_id=name, host="bench", backend="hostile", versions={}), ANSWER_TIMEOUT_S)
    return client


def _stall(hostile: Any, watch: Any, probe: Any, payload: bytes) -> tuple[float, bool]:
    """(seconds until the learner is free again, whether it answered the hostile message).

    libzmq drops a frame over MAXMSGSIZE by closing that connection, which the
    hostile socket's monitor reports; then the stall is what a request behind it waits.
    """
    from grpo_fleet.bench.simulated_actor import timed_request
    from grpo_fleet.protocol import messages as m
    from grpo_fleet.protocol.codec import encode
    from grpo_fleet.protocol.sockets import recv_frames, send_frames, wait_readable

    sent = time.perf_counter()
    send_frames(hostile.socket, [payload])
    while time.perf_counter() - sent < ANSWER_TIMEOUT_S:
        ready = wait_readable([hostile.socket, watch.monitor], 0.1)
        if hostile.socket in ready:
            recv_frames(hostile.socket, timeout_s=0)
            return time.perf_counter() - sent, True
        if watch.monitor in ready and watch.disconnected():
            _, probe_s = timed_request(probe, encode(m.Heartbeat(actor_id="probe")), ANSWER_TIMEOUT_S)
            return probe_s, False
    raise TimeoutError(f"no answer and no disconnect within {ANSWER_TIMEOUT_S} s")


def measure(endpoint: str, repeats: int) -> dict[str, dict]:
    """Worst stall per hostile message over `repeats` sends."""
    from grpo_fleet.protocol.sockets import DisconnectWatch, make_context

    ctx = make_context()
    hostile, probe = _registered(ctx, endpoint, "hostile"), _registered(ctx, endpoint, "probe")
    watch = DisconnectWatch(hostile.socket)
    results: dict[str, dict] = {}
    try:
        for name, payload in hostile_messages().items():
            runs = [_stall(hostile, watch, probe, payload) for _ in range(repeats)]
            results[name] = {"seconds": max(s for s, _ in runs), "answered": all(a for _, a in runs),
                             "bytes": len(payload)}
    finally:
        watch.close()
        hostile.close()
        probe.close()
        ctx.term()
    return results


def _decode_seconds(payload: bytes, limits: Any) -> float:
    """In-process: what decoding (and refusing) the message costs with these limits."""
    from grpo_fleet.protocol.codec import ProtocolError, decode

    started = time.perf_counter()
    try:
        decode(payload, limits)
    except ProtocolError:
        pass
    return time.perf_counter() - started


def _baseline_seconds(run_dir: Path) -> Optional[tuple[float, float]]:
    """(pre-fix limits, the learner's limits) decode time of the issue's message; None on older code."""
    try:
        from grpo_fleet.config import RunConfig
        from grpo_fleet.learner.door.intake_rules import inbound_limits
        from grpo_fleet.protocol.codec import DEFAULT_LIMITS, Limits
    except ImportError:
        return None
    cfg = RunConfig.model_validate(json.loads((run_dir.parent / f"{run_dir.name}.json").read_text()))
    payload = hostile_messages()["100k one-token completions"]
    # Before: only the byte cap of server.max_message_bytes, no structural pre-check.
    before = Limits(max_message_bytes=cfg.server.max_message_bytes, max_bin_len=cfg.server.max_message_bytes)
    assert before.max_array_len == DEFAULT_LIMITS.max_array_len
    return _decode_seconds(payload, before), _decode_seconds(payload, inbound_limits(cfg))


def report_stalls(report: Report, results: dict[str, dict], baseline: Optional[tuple[float, float]]) -> None:
    for name, result in results.items():
        how = "answered" if result["answered"] else "dropped unanswered at the byte limit; heartbeat behind it"
        report.add(Figure("hostile", f"loop stall: {name}", result["seconds"] * 1000, "ms",
                          notes=f"{result['bytes'] / 1e6:.1f} MB Rollouts, {how}"))
    worst = max(r["seconds"] for r in results.values())
    report.add(Figure(
        "hostile", "worst-case loop stall under hostile input", worst * 1000, "ms",
        baseline=baseline[0] * 1000 if baseline else None,
        baseline_name="the 14 MB message decoded in-process with pre-fix limits" if baseline else None,
        notes=f"the learner's limits decode it in {baseline[1] * 1000:.2f} ms in-process" if baseline else "",
    ))


def _slow_submission_stall(submitter: Any, probe: Any) -> float:
    """Seconds a Heartbeat waits while the learner re-scores one group with the slow reward."""
    from grpo_fleet.bench.simulated_actor import timed_request
    from grpo_fleet.protocol import messages as m
    from grpo_fleet.protocol.codec import decode, encode
    from grpo_fleet.protocol.sockets import recv_frames, send_frames

    lease = submitter.request(m.LeaseRequest(max_groups=1), ANSWER_TIMEOUT_S)
    completion = m.Completion(tokens=m.Tensor.from_numpy(np.asarray([5], np.int32)),
                              logprobs=m.Tensor.from_numpy(np.asarray([-1.0], np.float32)), reward=0.0,
                              finish_reason="length")
    groups = [m.GroupResult(group_id=p.group_id, completions=[completion] * GROUP_SIZE) for p in lease.prompts]
    send_frames(submitter.socket, [encode(m.Rollouts(lease_id=lease.lease_id, policy_version=lease.policy_version,
                                                     groups=groups))])
    time.sleep(0.2)  # the learner is re-scoring it now
    _, stall = timed_request(probe, encode(m.Heartbeat(actor_id="probe")), ANSWER_TIMEOUT_S)
    frames = recv_frames(submitter.socket, timeout_s=ANSWER_TIMEOUT_S)
    assert frames is not None and isinstance(decode(frames[0]), m.Ack), "the submission was never answered"
    return stall


def slow_reward_stalls(root: Path, repeats: int) -> list[float]:
    """Heartbeat round trips while a 2-second reward re-scores a submission, on a learner that verifies rewards."""
    from grpo_fleet.protocol.sockets import make_context

    rewards = root / "slow_rewards.py"
    rewards.write_text(SLOW_REWARD)
    learner = start_learner(root, "slow-reward", overrides={
        "task": {"reward_module": str(rewards), "rewards": ["slow"], "reward_timeout_seconds": 10.0},
        "security": {"verify_rewards": True}})
    ctx = make_context()
    try:
        wait_serving(learner)
        submitter, probe = _registered(ctx, learner.endpoint, "submitter"), _registered(ctx, learner.endpoint, "probe")
        try:
            return [_slow_submission_stall(submitter, probe) for _ in range(repeats)]
        finally:
            submitter.close()
            probe.close()
    finally:
        ctx.term()
        stop_learner(learner)


def run(report: Report, scale: Scale) -> None:
    """One learner, the hostile messages, the stall figures; then the slow reward's."""
    with tempfile.TemporaryDirectory(prefix="grpo-fleet-hostile-") as tmp:
        learner = start_learner(Path(tmp), "hostile")
        try:
            wait_serving(learner)
            results = measure(learner.endpoint, repeats=2 if scale is Scale.QUICK else 3)
            baseline = _baseline_seconds(learner.run_dir)
        finally:
            stop_learner(learner)
        slow = slow_reward_stalls(Path(tmp), repeats=2 if scale is Scale.QUICK else 3)
    report_stalls(report, results, baseline)
    report.add(Figure("hostile", f"worst request stall while a {SLOW_REWARD_SECONDS:g} s reward re-scores a "
                      "submission", max(slow) * 1000, "ms", goal="<= 100 ms",
                      notes=f"Heartbeat round trips {', '.join(f'{x * 1000:.0f}' for x in slow)} ms"))


def merge_into(path: Path, report: Report) -> None:
    """Put this run's figures into an existing results.json, replacing earlier ones of this benchmark."""
    from dataclasses import asdict

    data = json.loads(path.read_text()) if path.exists() else {"figures": []}
    names = {f.benchmark for f in report.figures}
    data["figures"] = [f for f in data["figures"] if f["benchmark"] not in names]
    data["figures"] += [{**asdict(f), "ratio": f.ratio} for f in report.figures]
    path.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    import sys

    standalone = Report()
    run(standalone, Scale.FULL)
    print(standalone.table())
    if len(sys.argv) > 1:
        merge_into(Path(sys.argv[1]), standalone)

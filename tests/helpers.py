"""Waiting and scraping helpers the integration tests share, and sample records (tests/ is on sys.path through its conftest)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import mlx.core as mx
from prometheus_client.parser import text_string_to_metric_families

from grpo_fleet.learner.records.runlog import StepRecord


class Scraped:
    """One /metrics page: its text and its samples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def total(self, name: str) -> float:
        """The sum of every sample called `name`, across label sets (0 when absent)."""
        return sum(s.value for s in self.samples if s.name == name)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called `name` whose labels include `labels` (0 when none)."""
        wanted = labels.items()
        return sum(s.value for s in self.samples if s.name == name and wanted <= s.labels.items())

    def totals(self) -> dict[str, float]:
        """Every sample name with its sum across label sets."""
        out: dict[str, float] = {}
        for sample in self.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def by_label(self, label: str) -> dict[tuple[str, str], float]:
        """(sample name, value of `label` or "") -> value."""
        return {(s.name, s.labels.get(label, "")): s.value for s in self.samples}


# Ports the tests hand out lie below the kernel's ephemeral range (32768-60999 on Linux, 49152 and up on macOS),
# where no outgoing connection's local end can take one between the pick and the bind (a port picked by bind(0)
# could be: a ring rank then connected to a stranger, and the ring proof failed). Each pytest-xdist worker walks a
# slice of its own, from a start of its own, so no two tests of a session are handed the same port.
PORTS_FIRST, PORTS_PER_WORKER, PORT_SLICES = 10_000, 2_500, 8
_next_port: list[int] = []


def _worker_slice() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return (int(worker[2:]) + 1) % PORT_SLICES if worker.startswith("gw") and worker[2:].isdigit() else 0


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port P on 127.0.0.1 with P .. P + count - 1 free right now, not handed out before in this test process."""
    low = PORTS_FIRST + _worker_slice() * PORTS_PER_WORKER
    if not _next_port:  # another session on this machine (a second make test) starts elsewhere in the slice
        _next_port.append(random.Random(os.getpid()).randrange(PORTS_PER_WORKER))
    for _ in range(PORTS_PER_WORKER):
        offset = _next_port[0]
        _next_port[0] = (offset + count) % PORTS_PER_WORKER
        if offset + count > PORTS_PER_WORKER:
            continue
        if all(_bindable(low + offset + i) for i in range(count)):
            return low + offset
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{low + PORTS_PER_WORKER - 1}")


def free_port_pair() -> int:
    """A port P with P and P + 1 both free on 127.0.0.1 (mlx.launch's ring, and rank metrics, take P + rank)."""
    return free_port(2)


def scrape(port: int, timeout: float = 5.0) -> Scraped:
    """GET http://127.0.0.1:PORT/metrics (raises OSError while nothing serves it)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        return Scraped(response.read().decode())


def _log_tail(proc: Any) -> str:
    path: Optional[Path] = getattr(proc, "log_path", None)
    return path.read_text()[-3000:] if path is not None and path.exists() else ""


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 90.0, procs: Iterable[Any] = ()) -> Any:
    """Poll `predicate` until it returns something truthy; OSError counts as not yet. Fails if a process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"{proc.args} died while waiting for {what}: {_log_tail(proc)}"
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def reward_children(parent: int) -> list[int]:
    """The reward processes `parent` spawned (multiprocessing's spawn children; not its resource tracker)."""
    found = subprocess.run(["pgrep", "-P", str(parent), "-f", "spawn_main"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file (none while it does not exist)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@dataclass(frozen=True)
class LedgerAudit:
    """ledger.jsonl read back: accepted group ids in order, and the drop line of each one dropped untrained."""

    accepted: list[str]
    dropped: dict[str, dict]
    unchecked: dict[str, str]  # group id -> why it trained without a logprob check

    @property
    def trained(self) -> set[str]:
        """Accepted and never dropped: what went to (or waits for) a step."""
        return set(self.accepted) - set(self.dropped)


def finished_in_checkpoint(scheduler: dict) -> set[str]:
    """The finished group ids a checkpoint's scheduler state implies: every id handed out that is not live
    (leased or queued again); the learner derives them the same way (learner/records/lease_book.py)."""
    live = {g for g, _ in scheduler["requeued"]} | {g for lease in scheduler["leases"] for g, _ in lease["tickets"]}
    return {f"g{serial:08d}" for serial in range(1, scheduler["serial"] + 1)} - live


def audit_ledger(path: Path) -> LedgerAudit:
    """Read a ledger and check it is exactly-once: each group accepted once, dropped at most once after that.

    A drop (learner/records/state.py, BatchHandOff.drop) names the new group its prompt was retried as,
    which is never the dropped group itself.
    """
    accepted: list[str] = []
    dropped: dict[str, dict] = {}
    unchecked: dict[str, str] = {}
    for entry in jsonl(path):
        group = entry["group_id"]
        if entry.get("event") == "unchecked":
            assert group in accepted and group not in dropped and group not in unchecked, entry
            assert entry["reason"] in ("sampled_out", "verification_off", "version_gone"), entry
            unchecked[group] = entry["reason"]
        elif entry.get("event") == "dropped":
            assert group in accepted, f"group {group} dropped before it was accepted"
            assert group not in dropped, f"group {group} dropped twice"
            assert entry["retried_as"] != group and entry["reason"], entry
            dropped[group] = entry
        else:
            assert "event" not in entry, entry
            assert group not in accepted, f"group {group} accepted twice"
            accepted.append(group)
    return LedgerAudit(accepted, dropped, unchecked)


def wait_steps(run_dir: Path, count: int, proc: Any, timeout: float = 120.0) -> list[dict]:
    """metrics.jsonl once it holds `count` steps."""
    return wait_for(lambda: (rows := jsonl(run_dir / "metrics.jsonl")) and len(rows) >= count and rows,
                    f"{count} steps in {run_dir}", timeout, (proc,))


def step_record(step: int, **changes: Any) -> StepRecord:
    """A plausible metrics.jsonl record for `step`, its values moving with the step, `changes` applied."""
    values: dict[str, Any] = dict(
        step=step, policy_version=step, reward_mean=0.25 * step, reward_std=0.5, loss=-0.125 * step, kl=0.01,
        clip_fraction=0.0625, grad_norm=1.5, ratio_mean=1.0, offpolicy_gap_mean=0.01 * step, offpolicy_gap_max=0.5,
        is_capped_fraction=0.001 * step, completion_length_mean=4.5, completion_length_max=8.0, truncated_fraction=0.25,
        learning_rate=1e-4, skipped=None,
        peak_memory_bytes=1 << 20, groups=2, tokens=24 + step, staleness_mean=0.5, staleness_max=1, zero_variance_fraction=0.0,
        step_seconds=0.75, wall_seconds=10.0 * step, actors=1,
    )
    return StepRecord(**{**values, **changes})


# Logit gap under which two greedy choices count as a tie: fp32 and quantized-kernel noise is ~1e-5.
TIE_TOLERANCE = 1e-3
# In bf16 or fp16 logits, two correct code paths differ by a few roundings of the top logit: mlx_lm's
# cached decode against one full forward of the same bf16 checkpoint parted at a gap of 0.047 with the top
# logit at 2.66 (2.25 roundings, realshape 4-bit, 2026-12-02); base weights in place of that checkpoint's
# moved its logits by up to 0.29 (14 roundings).
TIE_ULPS = 4
HALF_EPSILON = {mx.bfloat16: 2.0 ** -7, mx.float16: 2.0 ** -10}


def learner_side_policy(checkpoint: Path, dtype: str) -> Any:
    """A checkpoint loaded the way the learner resumes it: its own model build (LoRA added by grpo-fleet, a
    quantized base kept quantized, weights in `dtype`, as mlx_lm keeps them) with the checkpoint's weights."""
    from grpo_fleet.config import LoraConfig
    from grpo_fleet.models.loading import load_checkpoint_weights, load_policy

    adapter_config = checkpoint / "adapter_config.json"
    if not adapter_config.exists():
        return load_policy(str(checkpoint), dtype=dtype, dequantize=False)
    config = json.loads(adapter_config.read_text())
    params = config["lora_parameters"]
    lora = LoraConfig(enabled=True, rank=params["rank"], scale=params["scale"], num_layers=config["num_layers"],
                      keys=params.get("keys"))
    policy = load_policy(json.loads((checkpoint / "grpo_fleet.json").read_text())["base_model"], lora=lora,
                         dtype=dtype, dequantize=False)
    load_checkpoint_weights(policy, checkpoint)
    return policy


def assert_checkpoint_generates_like_the_learner(checkpoint: Path, prompt: str, max_tokens: int) -> str:
    """mlx_lm's greedy text from the checkpoint, loaded as a user loads it, equals grpo-fleet's own greedy
    decode (the actors' generation code) of the same checkpoint loaded the learner's way; returns the text.

    A random model's logits over a large vocabulary hold near-ties that two correct code paths (mlx_lm's
    prefill and decode against ours) may break differently. Where the two greedy decodes part, both tokens
    must be the learner's near-argmax on the shared prefix (within `TIE_TOLERANCE` of the top logit, or
    `TIE_ULPS` roundings of it when the logits are bf16 or fp16: far below the spread that wrong weights
    cause); everything before that point must be identical."""
    import mlx_lm
    import numpy as np
    from mlx.utils import tree_flatten

    from grpo_fleet.models.generation import SamplingSettings, completion_text, generate_groups
    from grpo_fleet.models.loading import load_checkpoint

    model, tokenizer = load_checkpoint(checkpoint)
    prompt_ids = tokenizer.encode(prompt)
    theirs = [int(r.token) for r in mlx_lm.stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens)]
    # The same dtype on both sides: a random model's greedy choice flips between bf16 and fp32 logits.
    floating = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    policy = learner_side_policy(checkpoint, str(max(set(floating), key=floating.count)).rsplit(".", 1)[-1])
    eos = set(int(t) for t in policy.tokenizer.eos_token_ids)
    settings = SamplingSettings(group_size=1, max_tokens=max_tokens, temperature=0.0, stop_token_ids=sorted(eos))
    (completion,) = generate_groups(policy.model, [np.asarray(prompt_ids, np.int32)], settings)[0]
    ours = list(completion.tokens)
    shared = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
    if shared < min(len(theirs), len(ours)):
        raw = policy.model(mx.array([prompt_ids + ours[:shared]], dtype=mx.int32))[0, -1]
        logits = raw.astype(mx.float32)
        top = float(logits.max())
        gaps = {token: top - float(logits[token]) for token in (theirs[shared], ours[shared])}
        tolerance = max(TIE_TOLERANCE, TIE_ULPS * HALF_EPSILON.get(raw.dtype, 0.0) * abs(top))
        assert max(gaps.values()) <= tolerance, (
            f"greedy decodes part at token {shared}: mlx_lm chose {theirs[shared]}, the learner's own decode "
            f"{ours[shared]}; their logits are {gaps} below the learner's top logit, not a near-tie")
    else:
        assert theirs == ours, f"mlx_lm.generate gave tokens {theirs}, the learner's own decode {ours}"
    return completion_text(policy.tokenizer, completion, eos)


# A user's environment (nothing imported from grpo_fleet), deterministic, whose rewards vary even for the tiny model:
# two turns, each scored by its reply's length.
LENGTHS_ENV = '''
class Lengths:
    deterministic = True

    def __init__(self, env_config, extras):
        self.turn = 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.turn += 1
        observations = [] if self.turn == 2 else [{"role": "user", "content": "Once more."}]
        return {"observations": observations, "reward": (len(action) % 3) / 2, "done": self.turn == 2,
                "metadata": {}}
'''

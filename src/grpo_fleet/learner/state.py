"""The learner's resumable state on disk: msgpack with arrays as raw bytes (never pickle)."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import numpy as np

from grpo_fleet.learner.batch import AcceptedGroup, CompletionRecord

STATE_FILE = "learner_state.msgpack"


def group_to_dict(group: AcceptedGroup) -> dict:
    """An accepted group as plain msgpack-able data."""
    return {
        "group_id": group.group_id,
        "prompt_index": group.prompt_index,
        "prompt_tokens": np.ascontiguousarray(group.prompt_tokens, dtype="<i4").tobytes(),
        "policy_version": group.policy_version,
        "actor_id": group.actor_id,
        "actor_key": group.actor_key,
        "completions": [
            {
                "tokens": np.ascontiguousarray(c.tokens, dtype="<i4").tobytes(),
                "logprobs": np.ascontiguousarray(c.logprobs, dtype="<f4").tobytes(),
                "reward": float(c.reward),
                "finish_reason": c.finish_reason,
            }
            for c in group.completions
        ],
    }


def group_from_dict(data: dict) -> AcceptedGroup:
    """Inverse of `group_to_dict`."""
    return AcceptedGroup(
        group_id=data["group_id"],
        prompt_index=data["prompt_index"],
        prompt_tokens=np.frombuffer(data["prompt_tokens"], dtype="<i4").astype(np.int32),
        completions=[
            CompletionRecord(
                tokens=np.frombuffer(c["tokens"], dtype="<i4").astype(np.int32),
                logprobs=np.frombuffer(c["logprobs"], dtype="<f4").astype(np.float32),
                reward=c["reward"],
                finish_reason=c["finish_reason"],
            )
            for c in data["completions"]
        ],
        policy_version=data["policy_version"],
        actor_id=data["actor_id"],
        actor_key=data.get("actor_key", ""),  # absent in checkpoints written before it existed
    )


def write_state(directory: Path, state: dict) -> Path:
    """Write the state file durably (fsync) into a checkpoint staging directory."""
    path = directory / STATE_FILE
    with open(path, "wb") as handle:
        handle.write(msgpack.packb(state, use_bin_type=True))
        handle.flush()
        os.fsync(handle.fileno())
    return path


def read_state(directory: Path) -> dict:
    """Read what `write_state` wrote."""
    with open(directory / STATE_FILE, "rb") as handle:
        return msgpack.unpackb(handle.read(), raw=False, strict_map_key=False)


def truncate_log(path: Path, size: int) -> None:
    """Cut an append-only JSONL log back to the length it had at the checkpoint."""
    if path.exists() and path.stat().st_size > size:
        with open(path, "r+b") as handle:
            handle.truncate(size)

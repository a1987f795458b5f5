"""Checkpoints and resume: a `LearnerState` saved with the weights and optimizer, atomically, and loaded back.

`capture` copies the state under the learner's lock (cheap: containers only);
`save` does every slow thing (serialising, fsync, the weights) outside it, so
requests are answered while a checkpoint is written. The state file is msgpack
with arrays as raw bytes, never pickle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, cast

import mlx.core as mx
import msgpack
import numpy as np

from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.records.runlog import LogSizes, check_log_lengths, sync_logs
from grpo_fleet.learner.records.state import AckCache, LearnerState
from grpo_fleet.learner.step.gap_bounds import HALF_PRECISION_BOUND, HALF_PRECISION_TOKEN_BOUND
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.models.loading import Policy, load_checkpoint_weights, save_checkpoint
from grpo_fleet.protocol import messages as m
from grpo_fleet.runtime.checkpoint_dirs import OPTIMIZER_FILE, STATE_FILE, fresh_checkpoint_path, point_latest, prune

__all__ = ["OPTIMIZER_FILE", "STATE_FILE"]  # named here since checkpoints began; runtime/checkpoint_dirs.py holds them
HISTORY_FILE = "weight_history.safetensors"
# version -> the trainable weights of that version, as (name, array) pairs (the logprob check's WeightHistory).
KeptVersions = dict[int, list[tuple[str, mx.array]]]


@dataclass(frozen=True)
class SavedState:
    """A consistent copy of `LearnerState` at one moment, with the log lengths that match it."""

    run_id: str
    step: int
    version: int
    buffer: list[AcceptedGroup]
    acks: dict[str, m.Ack]
    accepted_since_step: int
    zero_variance_since_step: int
    scheduler: dict[str, Any]  # PromptScheduler.state_dict()
    logs: LogSizes
    wall_seconds: float
    weights_published: bool = True  # the saved weights are version `version`'s (not past it)
    actor_ids: dict[str, str] = field(default_factory=dict)  # ActorIds.bindings(): actor id -> the key that owns it
    # Bans.export(): key -> [violations, times banned, end of its ban as wall-clock time (0: none)] (learner/actors/bans.py)
    bans: dict[str, list[float]] = field(default_factory=dict)


def capture(state: LearnerState, logs: LogSizes, bans: Optional[dict[str, list[float]]] = None) -> SavedState:
    """Copy what a checkpoint saves; call it under the lock that guards `state`, with the logs' sizes taken there
    (and the peers' bans, `Bans.export`, which live with the fleet rather than in `state`)."""
    return SavedState(
        run_id=state.run_id, step=state.step, version=state.version, buffer=list(state.buffer),
        acks=state.acks.answers(), accepted_since_step=state.accepted_since_step,
        zero_variance_since_step=state.zero_variance_since_step, scheduler=state.scheduler.state_dict(),
        logs=logs, wall_seconds=state.wall_seconds(), weights_published=state.weights_published,
        actor_ids=state.actor_ids.bindings(), bans=dict(bans or {}),
    )


def save(saved: SavedState, policy: Policy, trainer: Trainer, run_dir: Path, *, keep: int,
         history: Optional[KeptVersions] = None) -> Path:
    """Write weights (mlx-lm format), optimizer and state as a new directory, repoint `latest`, prune old ones.

    The order keeps a complete checkpoint, with logs at least as long as it records, named by `latest.json` at
    every instant, power cuts included: logs fsynced -> files written into a staging directory and fsynced ->
    renamed into place, the directory fsynced -> `latest.json` replaced the same way -> only then older ones
    removed. Touches no shared state, so it runs without the lock; the training thread
    calls it, and nothing else changes the weights or the optimizer meanwhile.
    `history`: the trainable weights of the versions the logprob check keeps (LoRA
    adapters: small), so that a resumed learner can still check what it accepts.
    """
    root = run_dir / "checkpoints"
    # The logs were flushed up to saved.logs when it was captured (under the lock); fsynced here, off it.
    sync_logs(run_dir)
    path = fresh_checkpoint_path(root, saved.step)
    meta = {"step": saved.step, "policy_version": saved.version, "run_id": saved.run_id}

    def write_extra(staging: Path) -> None:
        trainer.save_optimizer(staging / OPTIMIZER_FILE)
        if history:
            save_history(staging / HISTORY_FILE, history)
        write_state(staging, state_to_dict(saved))

    save_checkpoint(policy, path, extra=meta, write_extra=write_extra)
    point_latest(root, path, meta)
    prune(root, keep_name=path.name, keep=keep)
    return path


def load(checkpoint: Path, policy: Policy, trainer: Trainer) -> SavedState:
    """Load a checkpoint's weights and optimizer into `policy` and `trainer`; returns the state it saved."""
    saved = state_from_dict(read_state(checkpoint))
    check_log_lengths(checkpoint.parent.parent, saved.logs)  # before anything is loaded: a short log stops here
    load_checkpoint_weights(policy, checkpoint)
    trainer.load_optimizer(checkpoint / OPTIMIZER_FILE)
    return saved


def save_history(path: Path, history: KeptVersions) -> None:
    """Kept versions' weights as one safetensors file, keyed "<version>/<name>"."""
    arrays = {f"{version}/{name}": value for version, weights in history.items() for name, value in weights}
    mx.save_safetensors(str(path), arrays)


def load_history(checkpoint: Path) -> KeptVersions:
    """What `save_history` wrote ({} for a checkpoint without it: full fine-tuning, or written before it existed)."""
    path = checkpoint / HISTORY_FILE
    if not path.exists():
        return {}
    loaded = cast(dict[str, mx.array], mx.load(str(path)))
    history: KeptVersions = {}
    for key, value in loaded.items():
        version, name = key.split("/", 1)
        history.setdefault(int(version), []).append((name, value))
    return history


def restore(state: LearnerState, saved: SavedState) -> None:
    """Continue from `saved`: leases, finished groups, buffer and answers; this life keeps its incarnation."""
    state.run_id, state.step, state.version = saved.run_id, saved.step, saved.version
    state.buffer = list(saved.buffer)
    state.acks = AckCache(state.acks.size, saved.acks)
    state.accepted_since_step = saved.accepted_since_step
    state.zero_variance_since_step = saved.zero_variance_since_step
    state.scheduler.load_state_dict(saved.scheduler)
    state.actor_ids.load(saved.actor_ids)
    # Versions up to here were published, with these same weights, by the life
    # that wrote the checkpoint; work sampled from them is still good.
    state.history_version = saved.version
    if not saved.weights_published:
        # Saved after a step that did not publish (train.sync_every > 1): these weights are past version V, whose
        # weights the previous life's actors may still hold and sample from. Calling them V too would make
        # honest groups look tampered with (and their logprobs wrong): they become a version of their own.
        state.version = saved.version + 1
    state.weights_published = True
    state.started = time.monotonic() - saved.wall_seconds


# ---------------------------------------------------------------- the state file


def state_to_dict(saved: SavedState) -> dict[str, Any]:
    """`saved` as plain msgpack-able data (the keys every checkpoint so far has used, samples_bytes aside)."""
    return {
        "run_id": saved.run_id,
        "step": saved.step,
        "version": saved.version,
        "buffer": [group_to_dict(g) for g in saved.buffer],
        "acks": {lease_id: ack.model_dump() for lease_id, ack in saved.acks.items()},
        "accepted_since_step": saved.accepted_since_step,
        "zero_variance_since_step": saved.zero_variance_since_step,
        "scheduler": saved.scheduler,
        "ledger_bytes": saved.logs.ledger_bytes,
        "metrics_bytes": saved.logs.metrics_bytes,
        "samples_bytes": saved.logs.samples_bytes,
        "wall_seconds": saved.wall_seconds,
        "weights_published": saved.weights_published,
        "actor_ids": saved.actor_ids,
        "bans": saved.bans,
    }


def state_from_dict(data: dict[str, Any]) -> SavedState:
    """Inverse of `state_to_dict`."""
    return SavedState(
        run_id=data["run_id"], step=data["step"], version=data["version"],
        buffer=[group_from_dict(g) for g in data["buffer"]],
        # Checkpoints from protocol v1 stored Acks without their lease_id: it is the key.
        acks={lease_id: m.Ack(**{**ack, "lease_id": lease_id}) for lease_id, ack in data["acks"].items()},
        accepted_since_step=data["accepted_since_step"], zero_variance_since_step=data["zero_variance_since_step"],
        # Checkpoints from before samples.jsonl have no samples_bytes: that run had no samples yet.
        scheduler=data["scheduler"], logs=LogSizes(data["ledger_bytes"], data["metrics_bytes"], data.get("samples_bytes", 0)),
        wall_seconds=data["wall_seconds"],
        # Checkpoints from before this flag were read as published (what every resume assumed then).
        weights_published=data.get("weights_published", True),
        # Checkpoints from before ids were bound to keys bound none: the first Hello after the resume binds each.
        actor_ids=data.get("actor_ids", {}),
        # Checkpoints from before bans were saved kept none: a resume from one lifts every ban, as it always did.
        bans=data.get("bans", {}),
    )


def group_to_dict(group: AcceptedGroup) -> dict[str, Any]:
    """An accepted group as plain msgpack-able data."""
    return {
        "group_id": group.group_id,
        "prompt_index": group.prompt_index,
        "prompt_tokens": np.ascontiguousarray(group.prompt_tokens, dtype="<i4").tobytes(),
        "policy_version": group.policy_version,
        "actor_id": group.actor_id,
        "actor_key": group.actor_key,
        "check_logprobs": group.check_logprobs,
        "logprob_bound": group.logprob_bound,
        "token_bound": group.token_bound,
        "completions": [completion_to_dict(c) for c in group.completions],
    }


def completion_to_dict(c: CompletionRecord) -> dict[str, Any]:
    """One completion as plain data; an episode's mask, turns and end too (absent for a single completion)."""
    out: dict[str, Any] = {
        "tokens": np.ascontiguousarray(c.tokens, dtype="<i4").tobytes(),
        "logprobs": np.ascontiguousarray(c.logprobs, dtype="<f4").tobytes(),
        "reward": float(c.reward),
        "finish_reason": c.finish_reason,
    }
    if c.mask is not None:
        out.update(mask=np.ascontiguousarray(c.mask, dtype="u1").tobytes(), turns=list(c.turns or []), end=c.end)
    return out


def completion_from_dict(c: dict[str, Any]) -> CompletionRecord:
    """Inverse of `completion_to_dict`."""
    mask = c.get("mask")
    return CompletionRecord(
        tokens=np.frombuffer(c["tokens"], dtype="<i4").astype(np.int32),
        logprobs=np.frombuffer(c["logprobs"], dtype="<f4").astype(np.float32),
        reward=c["reward"],
        finish_reason=c["finish_reason"],
        mask=None if mask is None else np.frombuffer(mask, dtype="u1").copy(),
        turns=None if mask is None else [int(t) for t in c["turns"]],
        end=str(c.get("end", "")),
    )


def group_from_dict(data: dict[str, Any]) -> AcceptedGroup:
    """Inverse of `group_to_dict`."""
    return AcceptedGroup(
        group_id=data["group_id"],
        prompt_index=data["prompt_index"],
        prompt_tokens=np.frombuffer(data["prompt_tokens"], dtype="<i4").astype(np.int32),
        completions=[completion_from_dict(c) for c in data["completions"]],
        policy_version=data["policy_version"],
        actor_id=data["actor_id"],
        actor_key=data.get("actor_key", ""),  # absent in checkpoints written before it existed
        # Checkpoints from before the flags were saved lost them: such a group is checked again (never skipped).
        check_logprobs=data.get("check_logprobs", True),
        logprob_bound=data.get("logprob_bound", HALF_PRECISION_BOUND),
        token_bound=data.get("token_bound", HALF_PRECISION_TOKEN_BOUND),
    )


def write_state(directory: Path, data: dict[str, Any]) -> Path:
    """Write the state file into a checkpoint staging directory (save_checkpoint, models/loading.py, fsyncs it all)."""
    path = directory / STATE_FILE
    path.write_bytes(msgpack.packb(data, use_bin_type=True))
    return path


def read_state(directory: Path) -> dict[str, Any]:
    """Read what `write_state` wrote."""
    with open(directory / STATE_FILE, "rb") as handle:
        return msgpack.unpackb(handle.read(), raw=False, strict_map_key=False)

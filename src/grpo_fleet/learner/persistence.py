"""Checkpoints and resume for the learner: weights, optimizer and run state, written atomically.

A mixin of `Learner` so the bookkeeping in core.py stays readable; it reads and
writes the learner's own attributes (step, version, buffer, scheduler, logs).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from grpo_fleet.learner.state import group_from_dict, group_to_dict, read_state, truncate_log, write_state
from grpo_fleet.model import load_checkpoint_weights, save_checkpoint
from grpo_fleet.protocol import messages as m

log = logging.getLogger("grpo_fleet.learner")


class Persistence:
    """What `Learner` needs to survive a restart: `checkpoint()` and `resume()`."""

    def checkpoint(self) -> Path:
        """Write weights (mlx-lm format), optimizer and learner state in one atomic swap, then repoint `latest`."""
        with self.lock:
            return self._checkpoint()

    def _checkpoint(self) -> Path:
        self._metrics_file.flush()
        self._ledger_file.flush()
        root = self.run_dir / "checkpoints"
        path = root / f"step_{self.step:06d}"
        meta = {"step": self.step, "policy_version": self.version, "run_id": self.run_id}
        state = self.state_dict()

        def write_extra(staging: Path) -> None:
            self.trainer.save_optimizer(staging / "optimizer.safetensors")
            write_state(staging, state)

        save_checkpoint(self.policy, path, extra=meta, write_extra=write_extra)
        latest = root / "latest.json"
        tmp = latest.with_suffix(".tmp")
        tmp.write_text(json.dumps({"path": path.name, **meta}))
        tmp.replace(latest)
        self._prune_checkpoints(root, keep=path.name)
        return path

    def _prune_checkpoints(self, root: Path, keep: str) -> None:
        # Hidden staging directories are what a kill mid-checkpoint leaves behind.
        for leftover in root.glob(".step_*"):
            shutil.rmtree(leftover, ignore_errors=True)
        older = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != keep)
        for stale in older[: max(0, len(older) - self.cfg.train.keep_checkpoints + 1)]:
            shutil.rmtree(stale, ignore_errors=True)

    def state_dict(self) -> dict:
        """Everything besides weights and optimizer that a resume needs."""
        return {
            "run_id": self.run_id,
            "step": self.step,
            "version": self.version,
            "buffer": [group_to_dict(g) for g in self.buffer],
            "acks": {lease_id: ack.model_dump() for lease_id, ack in self.acks.items()},
            "accepted_since_step": self.accepted_since_step,
            "zero_variance_since_step": self.zero_variance_since_step,
            "scheduler": self.scheduler.state_dict(),
            "ledger_bytes": self._log_size(self._ledger_file),
            "metrics_bytes": self._log_size(self._metrics_file),
            "wall_seconds": time.monotonic() - self.started,
        }

    def forget_uncheckpointed_work(self) -> None:
        """Resuming a run that died before its first checkpoint: start over, logs included."""
        truncate_log(self.run_dir / "ledger.jsonl", 0)
        truncate_log(self.run_dir / "metrics.jsonl", 0)

    @staticmethod
    def _log_size(handle) -> int:
        handle.flush()
        return Path(handle.name).stat().st_size

    def resume(self, checkpoint: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, leases, finished groups, logs cut back to match."""
        state = read_state(checkpoint)
        load_checkpoint_weights(self.policy, checkpoint)
        self.trainer.load_optimizer(checkpoint / "optimizer.safetensors")
        self.run_id, self.step, self.version = state["run_id"], state["step"], state["version"]
        self.buffer = [group_from_dict(g) for g in state["buffer"]]
        self.acks = {lease_id: m.Ack(**ack) for lease_id, ack in state["acks"].items()}
        self.accepted_since_step = state["accepted_since_step"]
        self.zero_variance_since_step = state["zero_variance_since_step"]
        self.scheduler.load_state_dict(state["scheduler"])
        # Versions up to here were published, with these same weights, by the life
        # that wrote the checkpoint; work sampled from them is still good.
        self.history_version = self.version
        self.started = time.monotonic() - state["wall_seconds"]
        # Groups accepted after this checkpoint are forgotten here and re-queued by
        # their leases, so the ledger must forget them too to stay exactly-once.
        self._ledger_file.flush()
        self._metrics_file.flush()
        truncate_log(self.run_dir / "ledger.jsonl", state["ledger_bytes"])
        truncate_log(self.run_dir / "metrics.jsonl", state["metrics_bytes"])
        self._make_snapshot()
        self.metrics.policy_version.set(self.version)
        log.info("resumed run %s at step %d (policy v%d) from %s as incarnation %s",
                 self.run_id, self.step, self.version, checkpoint, self.incarnation)
